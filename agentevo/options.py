"""The `option()` field helper used by every config dataclass (kept apart so method configs can import it).

A numeric option carries its allowed range (`ge`, `gt`, `le`, `lt`) in the field metadata; `check_fields` checks
every such field of a config tree in one place, and rejects NaN and infinity in every float field.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any

from agentevo.errors import ConfigError

Number = int | float


def option(
    text: str,
    default: Any = dataclasses.MISSING,
    factory: Any = dataclasses.MISSING,
    *,
    ge: Number | None = None,
    gt: Number | None = None,
    le: Number | None = None,
    lt: Number | None = None,
) -> Any:
    """A dataclass field with a help string and, for numbers, its allowed range (each element's, for lists)."""
    metadata: dict[str, Any] = {"help": text}
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    if bounds:
        metadata["range"] = bounds
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def check_choice(section: str, name: str, value: object, allowed: tuple[str, ...]) -> None:
    """Raise a ConfigError naming section.name and the allowed values when value is not one of them."""
    if value not in allowed:
        raise ConfigError(f"{section}.{name} must be one of {', '.join(allowed)} (got {value!r})")


def _num(x: Number) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


def describe_range(bounds: dict[str, Number]) -> str:
    """'>= 1', '> 0', 'in [0, 1)', ... for a field's range metadata."""
    low = ("[", bounds["ge"]) if "ge" in bounds else ("(", bounds["gt"]) if "gt" in bounds else None
    high = ("]", bounds["le"]) if "le" in bounds else (")", bounds["lt"]) if "lt" in bounds else None
    if low and high:
        return f"in {low[0]}{_num(low[1])}, {_num(high[1])}{high[0]}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {_num(low[1])}"
    assert high is not None
    return f"{'<=' if high[0] == ']' else '<'} {_num(high[1])}"


def in_range(value: Number, bounds: dict[str, Number]) -> bool:
    """Whether value satisfies every bound."""
    return not (
        ("ge" in bounds and value < bounds["ge"]) or ("gt" in bounds and value <= bounds["gt"])
        or ("le" in bounds and value > bounds["le"]) or ("lt" in bounds and value >= bounds["lt"])
    )


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _nullable(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _check_number(value: Any, where: str, bounds: dict[str, Number] | None, nullable: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be a number (got {value!r})")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number (got {value!r})")
    if bounds and not in_range(value, bounds):
        raise ConfigError(f"{where} must be {describe_range(bounds)}{' or null' if nullable else ''} (got {value!r})")


def check_fields(obj: Any, where: str = "") -> None:
    """Check every numeric field of a config dataclass tree against its range; NaN/inf are never allowed."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        path = f"{where}.{f.name}" if where else f.name
        if dataclasses.is_dataclass(value):
            check_fields(value, path)
            continue
        if value is None or isinstance(value, (bool, str, dict)):
            continue
        bounds = f.metadata.get("range")
        if isinstance(value, (list, tuple)):
            for k, item in enumerate(value):
                if isinstance(item, (int, float)) and not isinstance(item, bool):
                    _check_number(item, f"{path}[{k}]", bounds, False)
            continue
        _check_number(value, path, bounds, _nullable(hints[f.name]))


def numeric_fields(cls: type, where: str = "") -> list[tuple[str, dataclasses.Field, Any]]:
    """(dotted path, field, type) of every int/float field (lists and tuples of numbers included) under cls."""
    out = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        path = f"{where}.{f.name}" if where else f.name
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out.extend(numeric_fields(tp, path))
            continue
        args = [a for a in typing.get_args(tp) if a is not type(None)] if _nullable(tp) else [tp]
        inner = args[0] if len(args) == 1 else None
        elems = typing.get_args(inner) if typing.get_origin(inner) in (list, tuple) else (inner,)
        if elems and all(e in (int, float) for e in elems):
            out.append((path, f, inner))
    return out
