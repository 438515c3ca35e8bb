#!/usr/bin/env python3
"""Writes src/berth/models.py: a dataclass for each object schema of the OpenAPI
document's components.schemas, and a Union alias for each oneOf of objects (each
variant a dataclass of its own, named after its discriminator: `AcquireEventQueued`).
Standard library only.

    python3 scripts/generate_models.py [--openapi ../../docs/openapi.json] [--out src/berth/models.py]

tests/test_models.py regenerates into a temporary file and fails when the committed
models.py differs, so the models follow the document.
"""

from __future__ import annotations

import argparse
import json
import keyword
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
DEFAULT_DOC = HERE.parents[2] / "docs" / "openapi.json"
DEFAULT_OUT = HERE.parent / "src" / "berth" / "models.py"
REF = "#/components/schemas/"
PRIMITIVES = {"string": "str", "integer": "int", "number": "float", "boolean": "bool"}

Schema = Dict[str, Any]


class Generator:
    def __init__(self, schemas: Dict[str, Schema]):
        self.schemas = schemas
        self.blocks: List[str] = []
        self.names: List[str] = []

    def render(self) -> str:
        for name, schema in self.schemas.items():
            self.define(name, schema)
        head = (
            '"""berth\'s API v1 models: generated from docs/openapi.json by\n'
            "scripts/generate_models.py. Do not edit; run the script again.\n\n"
            "Each object schema is a dataclass (`Run.from_dict(answer)`, `run.to_dict()`); a\n"
            "required property is a field without a default, a nullable one is `Optional`, an\n"
            "enum is a `Literal`, and a oneOf of objects is a `Union` of one dataclass per\n"
            'variant, told apart by its discriminator (`event`)."""\n\n'
            "from __future__ import annotations\n\n"
            "from dataclasses import dataclass, field\n"
            "from typing import Any, Dict, List, Literal, Optional, Union\n\n"
            "from ._model import Model\n"
        )
        names = sorted(self.names)
        exports = "__all__ = [\n" + "".join(f'    "{n}",\n' for n in names) + "]\n"
        return head + "\n" + exports + "".join("\n\n" + b for b in self.blocks)

    def define(self, name: str, schema: Schema) -> None:
        if "oneOf" in schema and all(v.get("type") == "object" for v in schema["oneOf"]):
            variants = []
            tag = discriminator(schema["oneOf"])
            for i, variant in enumerate(schema["oneOf"]):
                if tag:
                    value = str(variant["properties"][tag]["enum"][0])
                    suffix, what = camel(value), f'{name} with `{tag}: "{value}"`'
                else:
                    suffix, what = str(i + 1), f"{name}, variant {i + 1}"
                self.object(name + suffix, variant, what + ".")
                variants.append(name + suffix)
            doc = schema.get("description")
            comment = "".join(f"#: {line}\n" for line in doc.splitlines()) if doc else ""
            union = "".join(f"    {v},\n" for v in variants)
            self.blocks.append(f"{comment}{name} = Union[\n{union}]\n")
            self.names += [name] + variants
        elif schema.get("type") == "object":
            self.object(name, schema, f"The {name} schema.")
            self.names.append(name)
        else:
            raise SystemExit(f"{name}: only object schemas and oneOf of objects are supported")

    def object(self, name: str, schema: Schema, fallback: str) -> None:
        props: Dict[str, Schema] = schema.get("properties", {})
        required = set(schema.get("required", []))
        unknown = required - set(props)
        if unknown:
            raise SystemExit(f"{name}: required but not a property: {sorted(unknown)}")
        lines = ["@dataclass", f"class {name}(Model):"]
        lines += docstring(schema.get("description") or fallback)
        # A dataclass lists the fields without a default first: the required ones.
        order = [p for p in props if p in required] + [p for p in props if p not in required]
        for prop in order:
            sub = props[prop]
            annotation, nullable, doc = self.annotation(f"{name}.{prop}", sub)
            if not prop.isidentifier():
                raise SystemExit(f"{name}.{prop}: not a Python name")
            attr = prop + "_" if keyword.iskeyword(prop) else prop
            if prop not in required and not nullable:
                annotation = f"Optional[{annotation}]"  # absent reads as None
            lines += [f"    #: {line}".rstrip() for line in (doc or "").splitlines()]
            meta = f'metadata={{"json": "{prop}"}}' if attr != prop else ""
            if prop in required:
                default = f" = field({meta})" if meta else ""
            else:
                default = f" = field(default=None, {meta})" if meta else " = None"
            lines.append(f"    {attr}: {annotation}{default}")
        self.blocks.append("\n".join(lines) + "\n")

    def annotation(self, where: str, s: Schema) -> Tuple[str, bool, Optional[str]]:
        """The Python type of a property, whether it is nullable, and its description."""
        doc = s.get("description")
        if "$ref" in s:
            return self.ref(where, s["$ref"]), False, doc
        if "oneOf" in s:
            kinds = [v for v in s["oneOf"] if v.get("type") != "null"]
            if len(kinds) == 1 and len(s["oneOf"]) == 2:
                inner, _, inner_doc = self.annotation(where, kinds[0])
                return f"Optional[{inner}]", True, doc or inner_doc
            raise SystemExit(f"{where}: only oneOf [null, X] is supported inline")
        types = s.get("type")
        if types is None:
            return "Any", True, doc  # any JSON value, null included
        if isinstance(types, str):
            types = [types]
        nullable = "null" in types
        rest = [t for t in types if t != "null"]
        if len(rest) != 1:
            raise SystemExit(f"{where}: type {types} is not supported")
        t = rest[0]
        if t in PRIMITIVES:
            if "enum" in s:
                py = "Literal[" + ", ".join(json.dumps(v) for v in s["enum"]) + "]"
            else:
                py = PRIMITIVES[t]
        elif t == "array":
            py = f"List[{self.annotation(where + '[]', s['items'])[0]}]"
        elif t == "object":
            if s.get("properties"):
                raise SystemExit(f"{where}: an inline object with properties: give it a name")
            extra = s.get("additionalProperties", {})
            value = "Any" if extra in ({}, True) else self.annotation(where + "{}", extra)[0]
            py = f"Dict[str, {value}]"
        else:
            raise SystemExit(f"{where}: type {t} is not supported")
        return (f"Optional[{py}]" if nullable else py), nullable, doc

    def ref(self, where: str, ref: str) -> str:
        if not ref.startswith(REF) or ref[len(REF):] not in self.schemas:
            raise SystemExit(f"{where}: unknown reference {ref}")
        return ref[len(REF):]


def discriminator(variants: List[Schema]) -> Optional[str]:
    """The property every variant has as a one-value enum, its values all different."""
    prop: str
    for prop in variants[0].get("properties", {}):
        values = [v.get("properties", {}).get(prop, {}).get("enum") for v in variants]
        if all(isinstance(e, list) and len(e) == 1 for e in values) and \
                len({e[0] for e in values}) == len(values) and \
                all(prop in v.get("required", []) for v in variants):
            return prop
    return None


def camel(value: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in value.replace("-", "_").split("_"))


def docstring(text: str) -> List[str]:
    text = text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    body = text.splitlines()
    if len(body) == 1:
        return [f'    """{body[0]}"""', ""]
    return [f'    """{body[0]}'] + [f"    {line}".rstrip() for line in body[1:]] + ['    """', ""]


def render(doc: Dict[str, Any]) -> str:
    return Generator(doc["components"]["schemas"]).render()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--openapi", type=Path, default=DEFAULT_DOC, help="the OpenAPI document")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the module to write")
    args = ap.parse_args(argv)
    text = render(json.loads(args.openapi.read_text(encoding="utf-8")))
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
