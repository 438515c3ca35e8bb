"""berth.models is generated from the OpenAPI document, and decodes what it says."""

import subprocess
import sys
from pathlib import Path

import pytest

from berth import models
from berth._model import decode
from conftest import ROOT, openapi

HERE = Path(__file__).resolve().parents[1]


def test_models_py_is_what_the_generator_makes_of_the_openapi_document(tmp_path):
    out = tmp_path / "models.py"
    subprocess.run([sys.executable, str(HERE / "scripts" / "generate_models.py"),
                    "--openapi", str(ROOT / "docs" / "openapi.json"), "--out", str(out)],
                   check=True, capture_output=True)
    committed = (HERE / "src" / "berth" / "models.py").read_text()
    assert out.read_text() == committed, \
        "src/berth/models.py is stale: run python3 clients/python/scripts/generate_models.py"


def test_every_schema_is_a_model_with_its_properties():
    for name, schema in openapi()["components"]["schemas"].items():
        assert name in models.__all__, name
        if "properties" in schema:
            model = getattr(models, name)
            fields = {f.metadata.get("json", f.name) for f in model.__dataclass_fields__.values()}
            assert fields == set(schema["properties"]), name


def test_a_run_decodes_nested_nullable_and_enum_fields():
    answer = {
        "claim": {"keys": [{"key": "db", "mode": "exclusive"}], "resources": {"slots": 1}},
        "class": "analysis", "deadline": None, "env": {}, "expires_at": None, "ttl_ms": None,
        "ending": None, "fence": None, "labels": {}, "ports": {}, "position": 2,
        "priority": "background", "project": "p", "reason": {"code": "c", "message": "m"},
        "run_id": "r", "since": None, "state": "queued", "survivors": [], "usage": None, "workspace": None,
        "worktree": None, "a_field_from_a_newer_daemon": 1,
    }
    run = models.Run.from_dict(answer)
    assert run.class_ == "analysis" and run.claim.keys[0] == models.Key("db", "exclusive")
    assert run.reason == models.Reason("c", "m") and run.position == 2 and run.fence is None
    assert run.detached is None  # not required, absent
    back = run.to_dict()
    assert back["class"] == "analysis" and "detached" not in back and back["fence"] is None
    assert back == {k: v for k, v in answer.items() if k != "a_field_from_a_newer_daemon"}


@pytest.mark.parametrize("change, error", [
    ({"state": "asleep"}, "Run.state: 'asleep' is not one of"),
    ({"fence": "1"}, "Run.fence: expected int, got '1'"),
    ({"claim": {"keys": [{"key": "db"}], "resources": {}}}, "Run.claim.keys[0]: mode is missing"),
    ({"project": None}, "Run.project: expected str, got None"),
    ({"env": {"A": 1}}, "Run.env.A: expected str, got 1"),
])
def test_an_answer_that_breaks_its_schema_is_named_where(change, error):
    good = {"claim": {"keys": [], "resources": {}}, "class": "managed", "deadline": None,
            "env": {}, "expires_at": None, "ttl_ms": None, "ending": None, "fence": 1,
            "labels": {}, "ports": {}, "position": None, "priority": "foreground",
            "project": "p", "reason": None, "run_id": "r", "since": None, "state": "granted",
            "survivors": [], "usage": None, "workspace": None, "worktree": None}
    models.Run.from_dict(good)
    with pytest.raises(ValueError) as e:
        models.Run.from_dict({**good, **change})
    assert str(e.value).startswith(error)


def test_a_oneof_decodes_to_the_variant_its_discriminator_names():
    queued = decode(models.AcquireEvent, {"event": "queued", "run_id": "r", "position": 1,
                                          "reason": None})
    assert isinstance(queued, models.AcquireEventQueued) and queued.position == 1
    failed = decode(models.RuntimeEvent, {"event": "failed", "port": "web", "why": "exit 1",
                                          "log_tail": ["boom"]})
    assert isinstance(failed, models.RuntimeEventFailed) and failed.log_tail == ["boom"]
    with pytest.raises(ValueError, match="fits 0 of"):
        decode(models.AcquireEvent, {"event": "paused", "run_id": "r"})


def test_a_request_body_is_checked_and_keeps_its_json_names():
    body = models.AcquireRequest.of({"project": "p", "class": "analysis", "ttl_s": 60})
    assert body.class_ == "analysis"
    assert body.to_dict() == {"project": "p", "class": "analysis", "ttl_s": 60}
    assert models.AcquireRequest.of({"project": "p", "class_": "managed"}).to_dict()["class"] == "managed"
    with pytest.raises(ValueError, match="'urgent' is not one of"):
        models.AcquireRequest.of({"project": "p", "priority": "urgent"})
    with pytest.raises(TypeError, match="AcquireRequest has no field 'projet'"):
        models.AcquireRequest.of({"projet": "p"})
