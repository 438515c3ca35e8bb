"""berth's Python client: fenced leases for agent runs.

    import berth
    with berth.lease(project="shop", resources={"memory": 1 << 30}) as lease:
        run_agent(env=lease.env)          # renewed in the background, released on exit

    async with berth.alease(project="shop") as lease:   # the same, for asyncio
        await run_agent(env=lease.env)

`Client` and `AsyncClient` speak berth's HTTP API v1 (the daemon's default is
http://127.0.0.1:7420; the token is BERTH_TOKEN, else the state dir's admin.token), one
method per operation of the OpenAPI document (`OPERATIONS`), answering the dataclasses
of `berth.models` (generated from that document). Refusals raise `BerthError` with the
API's stable `code`, `message` and `details`.
"""

from . import models
from ._api import BerthError, Call, Lease, operations
from ._async import AsyncClient, alease
from ._sync import Client, lease

__all__ = ["AsyncClient", "BerthError", "Call", "Client", "Lease", "OPERATIONS", "alease",
           "lease", "models", "operations"]

#: Each operation of the OpenAPI document (`operationId`) and the method that calls it,
#: the same in `Client` and `AsyncClient` (tests check both cover the document).
OPERATIONS = operations(Client)
