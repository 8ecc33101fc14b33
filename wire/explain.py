"""Why a body does not fit the schema, field by field: the slow path.

A body that decodes straight into wire/schema.py's structs is fine, and
most are. One that does not is read again with `json` (which also takes
NaN and Infinity, so that a non-finite number is named where it is, not
refused as not JSON) and walked against the same declarations: the first
problem in a strict field raises `WireError(field, reason)`, and a bad entry
of a list marked `EACH` is left out and named in `dropped`. What is left is
plain values the structs take.
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec.inspect as mi

from wire.checks import Dropped, Field, WireError, integer, items, name, number, obj


def checked(value: Any, kind: mi.Type, field: Field, dropped: Dropped | None,
            siblings: dict[str, Any] | None = None) -> Any:  # fmt: skip
    """`value` as `kind` declares it, or WireError naming the problem.
    `siblings`: the fields of the same object checked before it."""
    extra: dict[str, Any] = {}
    if isinstance(kind, mi.UnionType):  # X | None: null or absent is "not measured"
        if value is None:
            return None
        kind = next(k for k in kind.types if not isinstance(k, mi.NoneType))
    if isinstance(kind, mi.Metadata):
        extra, kind = kind.extra or {}, kind.type
    if isinstance(kind, mi.StructType):
        src, out = obj(value, field), dict[str, Any]()
        for f in kind.fields:
            v = src.get(f.encode_name)
            # Absent is "not measured" wherever a field is optional; null only where it is declared `| None`.
            if v is not None or f.required or (f.encode_name in src and not _nullable(f.type)):
                out[f.encode_name] = checked(v, f.type, (field, f.encode_name), dropped, out)
        return out
    if isinstance(kind, (mi.ListType, mi.VarTupleType)):
        entries = items(value, field, kind.max_length if kind.max_length is not None else 1 << 31)
        if not extra.get("each") or dropped is None:
            return [checked(v, kind.item_type, (field, i), dropped) for i, v in enumerate(entries)]
        kept = []
        for i, v in enumerate(entries):
            try:
                kept.append(checked(v, kind.item_type, (field, i), dropped))
            except WireError as e:
                dropped.append({"field": e.field, "reason": e.reason})
        return kept
    if isinstance(kind, mi.FloatType):
        lo = _bound(kind.ge, -math.inf)
        if "not_before" in extra and siblings is not None:  # a window's end: not before its start
            lo = max(lo, siblings[extra["not_before"]])
        return number(value, field, lo, _bound(kind.le, math.inf))
    if isinstance(kind, mi.IntType):
        return integer(value, field, int(_bound(kind.ge, -(1 << 63))), int(_bound(kind.le, 1 << 63)))
    if isinstance(kind, mi.StrType):
        if kind.pattern is not None:
            if not isinstance(value, str) or not re.search(kind.pattern, value):
                raise WireError(field, extra.get("reason", f"must match {kind.pattern}"))
            return value
        return name(value, field, kind.max_length if kind.max_length is not None else 1 << 31)
    if isinstance(kind, mi.BoolType):
        if not isinstance(value, bool):
            raise WireError(field, "must be true or false")
        return value
    if isinstance(kind, mi.LiteralType):
        if value not in kind.values or isinstance(value, bool):
            raise WireError(field, "must be " + " or ".join(repr(v) for v in kind.values))
        return value
    if isinstance(kind, mi.RawType):
        return value
    raise TypeError(f"{field}: the schema declares {kind!r}, which the explainer does not know")


def _nullable(kind: mi.Type) -> bool:
    return isinstance(kind, mi.UnionType) and any(isinstance(k, mi.NoneType) for k in kind.types)


def _bound(value: float | None, default: float) -> float:
    return default if value is None else value
