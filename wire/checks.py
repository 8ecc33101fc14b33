"""The checks every field of a body goes through, and the error that names
the first problem: `WireError(field, reason)`, answered 400 (or, for one
entry of a list, that entry left out and named in `dropped`)."""

from __future__ import annotations

import math
from typing import Any

from wire.limits import MAX_NAME, NODE_ID

Json = dict[str, Any]


Field = str | tuple[Any, ...]  # a field's path; a tuple is joined only when an error names it


def field_name(path: Field) -> str:
    if isinstance(path, str):
        return path
    out = ""
    for part in path:
        if isinstance(part, tuple):
            out += ("." if out else "") + field_name(part) if part else ""
        elif isinstance(part, int):
            out += f"[{part}]"
        elif part:
            out += ("." if out else "") + part
    return out


class WireError(ValueError):
    def __init__(self, field: Field, reason: str) -> None:
        self.field, self.reason = field_name(field), reason
        super().__init__(f"{self.field}: {reason}")


def node_id(value: Any, field: Field = "node") -> str:
    if not isinstance(value, str) or not NODE_ID.fullmatch(value):
        raise WireError(field, "must be 1-253 letters, digits, '.', '-' or '_'")
    return value


def name(value: Any, field: Field, limit: int = MAX_NAME) -> str:
    """Free printable text (kept as given; escaped wherever it is shown)."""
    if not isinstance(value, str):
        raise WireError(field, "must be a string")
    if not 0 < len(value) <= limit:
        raise WireError(field, f"must be 1-{limit} characters")
    if not value.isprintable():
        raise WireError(field, "must be printable text (no control characters)")
    return value


def number(value: Any, field: Field, lo: float, hi: float) -> float:
    kind = type(value)
    if kind is not float and kind is not int:  # bool is neither
        raise WireError(field, "must be a number")
    if not lo <= value <= hi:  # NaN fails this too; json.loads refused it already
        if not math.isfinite(value):
            raise WireError(field, "must be finite")
        raise WireError(field, f"must be within {lo:g}..{hi:g}")
    return float(value)


def integer(value: Any, field: Field, lo: int, hi: int) -> int:
    if type(value) is not int:  # bool is not
        raise WireError(field, "must be an integer")
    if not lo <= value <= hi:
        raise WireError(field, f"must be within {lo}..{hi}")
    return value


def obj(value: Any, field: Field) -> Json:
    if not isinstance(value, dict):
        raise WireError(field, "must be an object")
    return value


def items(value: Any, field: Field, limit: int) -> list[Any]:
    if not isinstance(value, list):
        raise WireError(field, "must be a list")
    if len(value) > limit:
        raise WireError(field, f"at most {limit} entries")
    return value


Dropped = list[dict[str, str]]  # {"field": ..., "reason": ...} of each entry left out
