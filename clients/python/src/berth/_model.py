"""The runtime half of the generated models (models.py): JSON in, checked against each
dataclass's annotations, and JSON out."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Dict, List, Literal, Mapping, Tuple, Type, TypeVar, Union, cast

M = TypeVar("M", bound="Model")

#: (attribute, JSON name, type, required) of each field of a model.
_Field = Tuple[str, str, Any, bool]
_FIELDS: Dict[type, Tuple[_Field, ...]] = {}


class Model:
    """A schema of the OpenAPI document, as a dataclass (see models.py)."""

    @classmethod
    def from_dict(cls: Type[M], data: Any) -> M:
        """Decodes JSON (as `json.loads` gives it); `ValueError` names what does not fit.
        Properties the schema does not know are ignored."""
        return cast(M, decode(cls, data, cls.__name__))

    @classmethod
    def of(cls: Type[M], fields: Mapping[str, Any]) -> M:
        """From keyword arguments by JSON name (`class`) or attribute (`class_`), checked:
        `TypeError` for an unknown or missing field, `ValueError` for a value of the
        wrong type."""
        names = {key: attr for attr, key, _, _ in _fields(cls)}
        unknown = [k for k in fields if k not in names and k not in names.values()]
        if unknown:
            raise TypeError(f"{cls.__name__} has no field {', '.join(map(repr, unknown))} "
                            f"(its fields: {', '.join(names)})")
        made = cls(**{names.get(k, k): v for k, v in fields.items()})
        return cast(M, decode(cls, made.to_dict(), cls.__name__))

    def to_dict(self) -> Dict[str, Any]:
        """As JSON: optional fields that are None are left out."""
        out: Dict[str, Any] = encode(self)
        return out


def _fields(cls: type) -> Tuple[_Field, ...]:
    got = _FIELDS.get(cls)
    if got is None:
        hints = typing.get_type_hints(cls)
        got = tuple(
            (f.name, f.metadata.get("json", f.name), hints[f.name],
             f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls))
        _FIELDS[cls] = got
    return got


def _show(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def decode(tp: Any, value: Any, where: str = "answer") -> Any:
    """`value` (JSON) as `tp`: a model, a Union of models (told apart by their Literal
    fields), Optional, List, Dict, Literal, str, int, float, bool or Any."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin is Union:
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ValueError(f"{where}: null where {_show(tp)} is expected")
        options = [a for a in args if a is not type(None)]
        chosen = options[0] if len(options) == 1 else _variant(options, value, where)
        return decode(chosen, value, where)
    if origin is Literal:
        if not any(value == a and type(value) is type(a) for a in typing.get_args(tp)):
            raise ValueError(f"{where}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected an array, got {value!r}")
        (item,) = typing.get_args(tp)
        return [decode(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {value!r}")
        _, item = typing.get_args(tp)
        return {k: decode(item, v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, Model):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a {tp.__name__} object, got {value!r}")
        kwargs = {}
        for attr, key, ftp, required in _fields(tp):
            if key in value:
                kwargs[attr] = decode(ftp, value[key], f"{where}.{key}")
            elif required:
                raise ValueError(f"{where}: {key} is missing")
        return tp(**kwargs)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp in (str, int, bool):
        if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
            return value
        raise ValueError(f"{where}: expected {tp.__name__}, got {value!r}")
    raise TypeError(f"{where}: cannot decode into {_show(tp)}")


def _variant(options: List[Any], value: Any, where: str) -> Any:
    """The one model of a Union whose Literal fields (its discriminator) `value` has."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected an object, got {value!r}")
    fits = [o for o in options if isinstance(o, type) and issubclass(o, Model) and all(
        key in value and value[key] in typing.get_args(t)
        for _, key, t, _ in _fields(o) if cast(Any, typing.get_origin(t)) is Literal)]
    if len(fits) != 1:
        names = ", ".join(_show(o) for o in options)
        raise ValueError(f"{where}: fits {len(fits)} of {names}, not one: {value!r}")
    return fits[0]


def encode(value: Any) -> Any:
    """A model (or lists and dicts of them) as JSON."""
    if isinstance(value, Model):
        return {key: encode(getattr(value, attr))
                for attr, key, _, required in _fields(type(value))
                if required or getattr(value, attr) is not None}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    return value
