"""Settings as the single source of defaults, help, allowed values and validation.

Each command's settings are one dataclass whose fields are declared with :func:`setting`; the
click options (:func:`click_options`), job-file sections (:func:`from_mapping`) and library calls
all read the same fields, so a default or a choice list is written once. :func:`validate` checks
every value (type, finiteness, range, choices) and raises :class:`SettingError` naming the field;
the CLI turns the name into its flag (``calibration_tokens`` -> ``--calibration-tokens``).

Importing this module imports neither torch nor click.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from mha2gqa.core.errors import SettingError

_KEY = "mha2gqa"


@dataclass(frozen=True)
class Spec:
    """What the CLI and job files need to know about one setting beyond its type and default."""

    help: str
    choices: tuple[str, ...] | None = None
    minimum: float | None = None  # inclusive
    maximum: float | None = None  # inclusive
    above: float | None = None  # exclusive lower bound
    below: float | None = None  # exclusive upper bound
    short: str | None = None  # e.g. "-g"
    flag: str | None = None  # the option's name when it is not --field-name (e.g. --protocol)
    cli: bool = True  # offered as a command-line option
    empty: bool = False  # a list setting that may be empty (none of its choices)
    job: bool = True  # a job file may set it (False: the job decides it itself)
    identity: bool = False  # defines a run's trajectory: a resumed run must keep its value


def setting(default: Any = dataclasses.MISSING, help: str = "", **spec: Any) -> Any:
    """A dataclass field carrying its :class:`Spec` (``help``, ``choices``, bounds, ``short``...).
    Defaults are immutable (tuples for lists)."""
    return dataclasses.field(default=default, metadata={_KEY: Spec(help, **spec)})


def spec_of(field: dataclasses.Field) -> Spec:
    return field.metadata.get(_KEY) or Spec("")


def names_where(cls: type, flag: str) -> tuple[str, ...]:
    """The settings of ``cls`` whose :class:`Spec` has ``flag`` set (e.g. ``identity``)."""
    return tuple(f.name for f in dataclasses.fields(cls) if getattr(spec_of(f), flag))


_FLAGS: dict[str, str] = {}  # settings whose option is not --field-name (filled as options are built)


def flag(name: str) -> str:
    """The command-line flag of setting ``name``."""
    return _FLAGS.get(name) or "--" + name.replace("_", "-")


def check_switched(obj: Any, switch: str, *others: str) -> None:
    """Refuse a setting ``{switch}_*`` (or one of ``others``) of ``obj`` changed from its default while
    the boolean setting ``switch`` is off (``--refit-steps`` without ``--refit``)."""
    if getattr(obj, switch):
        return
    for field in dataclasses.fields(obj):
        ours = field.name.startswith(f"{switch}_") or field.name in others
        if ours and getattr(obj, field.name) != field.default:
            raise SettingError(field.name, f"{{name}} is a setting of {flag(switch)}: add {flag(switch)}")


@cache
def check_window(name: str, seq_len: int, positions: int | None) -> None:
    """A window of ``seq_len`` tokens (the setting ``name``'s) fits the model's ``positions`` (None:
    no limit known), else one error naming the setting: never cut to fit behind the user's back."""
    if positions and seq_len > positions:
        raise SettingError(
            name,
            f"{{name}} {seq_len} is longer than the model's {positions} positions; use {{name}} {positions} or less",
        )


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _kinds(annotation: Any) -> tuple[tuple[type, ...], bool, type | None]:
    """``(accepted scalar types, None allowed, element type of a tuple)`` of a field annotation."""
    optional = False
    args = (annotation,)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        optional = type(None) in args
        args = tuple(a for a in args if a is not type(None))
    scalar = []
    element = None
    for a in args:
        if typing.get_origin(a) is tuple:
            element = typing.get_args(a)[0]
            scalar.append(tuple)
        elif a in (int, float, str, bool):
            scalar.append(a)
    return tuple(scalar), optional, element


def _type_ok(value: Any, kinds: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, int):
        return int in kinds or float in kinds
    if isinstance(value, float):
        return float in kinds
    return isinstance(value, kinds) if kinds else True


def _type_name(kinds: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", tuple: "a list"}
    return " or ".join(names[k] for k in kinds if k in names) or "a value"


def check_value(name: str, value: Any, annotation: Any, spec: Spec) -> Any:
    """``value`` of setting ``name`` checked (and normalised: lists -> tuples, ints -> floats
    where a float is wanted); raises :class:`SettingError`."""
    kinds, optional, element = _kinds(annotation)
    if value is None:
        if optional:
            return None
        raise SettingError(name, "{name} needs a value")
    if tuple in kinds and isinstance(value, list | tuple):
        items = tuple(check_value(name, v, element, spec) for v in value)
        if not items and not spec.empty:
            raise SettingError(name, "{name} needs at least one value")
        return items
    if not _type_ok(value, kinds):
        raise SettingError(name, f"{{name}} must be {_type_name(kinds)} (got {value!r})")
    if isinstance(value, int) and not isinstance(value, bool) and int not in kinds:
        value = float(value)  # a whole number where a float is wanted
    if isinstance(value, float) and not math.isfinite(value):
        raise SettingError(name, f"{{name}} must be a finite number (got {value})")
    if spec.choices is not None and value not in spec.choices:
        raise SettingError(name, f"{{name}} {value!r}: choose one of {', '.join(map(str, spec.choices))}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        _check_bounds(name, value, spec)
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        raise SettingError(name, f"{{name}} {value} does not fit in 64 bits; check the number")
    return value


def _check_bounds(name: str, value: float, spec: Spec) -> None:
    if spec.minimum is not None and value < spec.minimum:
        raise SettingError(name, f"{{name}} must be at least {spec.minimum:g} (got {value:g})")
    if spec.maximum is not None and value > spec.maximum:
        raise SettingError(name, f"{{name}} must be at most {spec.maximum:g} (got {value:g})")
    if spec.above is not None and value <= spec.above:
        raise SettingError(name, f"{{name}} must be greater than {spec.above:g} (got {value:g})")
    if spec.below is not None and value >= spec.below:
        raise SettingError(name, f"{{name}} must be less than {spec.below:g} (got {value:g})")


def validate(obj: Any) -> Any:
    """Check every field of the settings dataclass ``obj`` (normalised in place); returns ``obj``."""
    hints = _hints(type(obj))
    for field in dataclasses.fields(obj):
        value = check_value(field.name, getattr(obj, field.name), hints[field.name], spec_of(field))
        object.__setattr__(obj, field.name, value)
    return obj


def from_mapping(
    cls: type,
    data: Mapping[str, Any] | None,
    where: str,
    fixed: Mapping[str, Any] | None = None,
) -> Any:
    """``cls(**data, **fixed)`` for a job-file section ``where``: unknown keys, wrong types and bad
    values are :class:`SettingError`\\ s naming ``where.key``; ``fixed`` keys and settings whose spec
    says ``job=False`` are not allowed."""
    data = dict(data or {})
    names = [f.name for f in dataclasses.fields(cls) if spec_of(f).job and f.name not in (fixed or {})]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise SettingError(unknown[0], f"unknown key '{where}.{{name}}'; known: {', '.join(names)}")
    try:
        obj = cls(**data, **(fixed or {}))
        return validate(obj)
    except SettingError as e:
        raise SettingError(e.setting, e.render(f"{where}.{e.setting}")) from None
    except TypeError as e:  # a required key is missing
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in data and f.name not in (fixed or {}) and f.default is dataclasses.MISSING
        ]
        raise SettingError(missing[0] if missing else where, f"'{where}.{{name}}' is required ({e})") from None


def _split_choices(ctx: Any, param: Any, values: tuple[str, ...], choices: tuple[str, ...] | None) -> tuple[str, ...]:
    """A repeatable option's values, each possibly a comma-separated list, checked against ``choices``."""
    import click

    out = tuple(v.strip() for value in values for v in value.split(",") if v.strip())
    if values and not out:  # `--tasks ''`: asked for, and names nothing
        raise click.BadParameter("names nothing: give at least one value, or leave the option out", ctx, param)
    for v in out if choices else ():
        if v not in choices:
            raise click.BadParameter(f"{v!r} is not one of {', '.join(map(repr, choices))}", ctx, param)
    return out


def click_options(cls: type, exclude: tuple[str, ...] = ()) -> Callable:
    """A decorator adding one click option per field of ``cls`` (but ``exclude`` and fields with
    ``cli=False``): ``--field-name`` (or the field's ``flag``), its type, choices, default and help
    from the field. Bools become ``--x/--no-x`` flags (plain ``--x`` when the
    default is False); tuple fields are repeatable."""
    import click

    hints = _hints(cls)

    def decorate(fn: Callable) -> Callable:
        for field in reversed(dataclasses.fields(cls)):
            spec = spec_of(field)
            if field.name in exclude or not spec.cli:
                continue
            kinds, _, element = _kinds(hints[field.name])
            default = field.default
            if spec.flag:
                _FLAGS[field.name] = spec.flag
            decls = [flag(field.name)] + ([spec.short] if spec.short else [])
            kwargs: dict[str, Any] = {"help": spec.help}
            base = element if tuple in kinds else (kinds[0] if kinds else str)
            if base is bool:
                if default:
                    decls = [f"{flag(field.name)}/--no-{flag(field.name)[2:]}"]
                kwargs["is_flag"] = True
            else:
                kwargs["type"] = click.Choice(list(spec.choices)) if spec.choices else base
            if tuple in kinds:
                kwargs["multiple"] = True
                if base is str:  # repeated, or comma-separated: --protocol disjoint,rolling
                    kwargs["type"] = str
                    if spec.choices:
                        kwargs["metavar"] = f"[{'|'.join(spec.choices)}]"
                    kwargs["callback"] = functools.partial(_split_choices, choices=spec.choices)
            if default is dataclasses.MISSING:
                kwargs["required"] = True
            else:
                kwargs["default"] = default
                if default is None:
                    kwargs["show_default"] = False
            fn = click.option(*decls, field.name, **kwargs)(fn)
        return fn

    return decorate
