"""Typed records read back from JSON: every field checked against its annotation (nested
dataclasses, optionals, lists, dicts, numbers), so a damaged or foreign file is one error naming
the file and the field, never a wrong number later.

``read(cls, data, where)`` builds ``cls`` from a JSON object; :func:`plain` (or ``asdict``) writes it
back. Fields with defaults may be absent (files written before they existed).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from functools import cache
from typing import Any

from mha2gqa.core.errors import Mha2GqaError


class RecordError(Mha2GqaError):
    """A record whose content is not what its schema says (message: ``where.field problem``)."""


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def read(cls: type, data: Any, where: str) -> Any:
    """``cls`` (a dataclass) from the JSON object ``data``; raises :class:`RecordError` naming
    ``where.field`` for a missing required field or a value of the wrong type, and ``where`` for what
    the value's own ``record_problem()`` finds wrong across its fields (None: nothing)."""
    if not isinstance(data, dict):
        raise RecordError(f"{where} is not an object")
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in data:
            kwargs[f.name] = value(hints[f.name], data[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise RecordError(f"{where}.{f.name} is missing")
    obj = cls(**kwargs)
    problem = obj.record_problem() if hasattr(obj, "record_problem") else None  # (facts across its fields)
    if problem:
        raise RecordError(f"{where} {problem}")
    return obj


def value(annotation: Any, data: Any, where: str) -> Any:
    """``data`` checked against ``annotation`` (and converted: dataclasses built, ints taken as floats)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return data
    if origin in (typing.Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options[:-1]:
            try:
                return value(option, data, where)
            except RecordError:
                continue
        return value(options[-1], data, where)
    if dataclasses.is_dataclass(annotation):
        return read(annotation, data, where)
    if origin is typing.Literal:
        if isinstance(data, bool) or data not in args:
            raise RecordError(f"{where} is {data!r:.40}, not one of {', '.join(map(repr, args))}")
        return data
    if origin is list or origin is tuple:
        if not isinstance(data, list | tuple):  # (a tuple: a record's to_dict() read before it is JSON)
            raise RecordError(f"{where} is not a list")
        items = [value(args[0], v, f"{where}[{i}]") for i, v in enumerate(data)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(data, dict):
            raise RecordError(f"{where} is not an object")
        return {k: value(args[1], v, f"{where}.{k}") for k, v in data.items()}
    if annotation is float:
        if isinstance(data, bool) or not isinstance(data, int | float):
            raise RecordError(f"{where} is not a number (got {data!r:.40})")
        return float(data)
    if annotation is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise RecordError(f"{where} is not an integer (got {data!r:.40})")
        return data
    if annotation in (str, bool):
        if not isinstance(data, annotation):
            raise RecordError(f"{where} is not a {annotation.__name__} (got {data!r:.40})")
        return data
    raise TypeError(f"unsupported annotation {annotation!r} at {where}")  # a bug in a record type


def plain(obj: Any) -> Any:
    """The JSON form of a record: a dataclass as the object of its fields (a field at its default of
    None or empty left out, as files written before it have it), or its own ``to_dict()`` where it
    has one; lists, tuples and dicts item by item."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if callable(getattr(obj, "to_dict", None)):
            return obj.to_dict()
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init and not unset(obj, f)}
    if isinstance(obj, list | tuple):
        return [plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    return obj


def unset(obj: Any, f: dataclasses.Field) -> bool:
    """``obj``'s field ``f`` holds its default of None, or the empty value its default factory makes."""
    value = getattr(obj, f.name)
    if f.default is None:
        return value is None
    return f.default_factory is not dataclasses.MISSING and value == f.default_factory() and not value
