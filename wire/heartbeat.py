"""The control plane's side of the wire: a registration or a heartbeat,
accepted only as wire/schema.py declares it.

Every field is checked for type, range, finiteness, length and characters,
every list for its length. Identity, structure and the machine's numbers
are strict: the first problem is raised as `WireError(field, reason)`,
answered 400. One bad entry of a list (a shard, a disk, a GPU) costs that
entry alone: it is left out, and named with its reason in the `dropped`
list the parser is given.

A body is decoded straight into the schema's structs (msgspec); only one
that does not fit is read again to say why (wire/explain.py). The consumers
take the checked heartbeat as plain dicts and lists, keyed as on the wire.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from wire.checks import Dropped, Json, WireError, obj
from wire.explain import checked
from wire.limits import MAX_BODY_BYTES
from wire.raw import parse_raw
from wire.schema import Heartbeat, Registration

S = TypeVar("S", Heartbeat, Registration)

_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {
    Heartbeat: msgspec.json.Decoder(Heartbeat),
    Registration: msgspec.json.Decoder(Registration),
}


def _decoded(data: bytes, kind: type[S], dropped: Dropped | None) -> tuple[S, Any]:
    """The body as `kind`, and its raw block: the struct's undecoded `raw`,
    or JSON values when the slow path read it."""
    if len(data) > MAX_BODY_BYTES:
        raise WireError("body", f"larger than {MAX_BODY_BYTES} bytes")
    try:
        body = _DECODERS[kind].decode(data)
        return body, getattr(body, "raw", None)
    except msgspec.DecodeError:  # ValidationError is one: not the schema's, or not JSON to msgspec
        return explained(data, kind, dropped)


def explained(data: bytes, kind: type[S], dropped: Dropped | None) -> tuple[S, Any]:
    """The slow path: the body read with `json` and walked against the
    schema, naming the first problem or leaving bad entries out."""
    try:
        # NaN and Infinity are not JSON, but Python writes them: read as floats,
        # they fail the range check of the field they are in, which names it
        # (and costs only that entry when it is one of a list's).
        value = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise WireError("body", f"not JSON: {str(e)[:120]}") from None
    value = checked(obj(value, "body"), msgspec.inspect.type_info(kind), "", dropped)
    raw = value.pop("raw", None)
    try:
        return msgspec.convert(value, kind), raw
    except msgspec.ValidationError as e:  # the explainer passed what the schema refuses: say it as msgspec does
        raise WireError("body", str(e)[:200]) from None


def parse_registration(data: bytes, dropped: Dropped | None = None) -> Json:
    registration, _ = _decoded(data, Registration, dropped)
    out: Json = msgspec.to_builtins(registration)
    return out


def parse_heartbeat(data: bytes, dropped: Dropped | None = None,
                    raw_for: Callable[[str], bool] | None = None) -> Json:  # fmt: skip
    """A heartbeat, checked. Its raw samples are read only for a node
    `raw_for` says is watched live; for any other they are not read (`raw`
    is then None, saying only that they came)."""
    hb, raw = _decoded(data, Heartbeat, dropped)
    shards = hb.shards
    if len({s.id for s in shards}) != len(shards):
        if dropped is None:
            raise WireError("shards", "shard ids must be unique")
        first: dict[str, Any] = {}
        for s in shards:
            if s.id in first:
                dropped.append({"field": "shards", "reason": "shard ids must be unique"})
            else:
                first[s.id] = s
        shards = list(first.values())
    hb.shards, hb.raw = shards, None
    out: Json = msgspec.to_builtins(hb)
    out["shards"] = out.get("shards", [])
    if raw is not None:  # None when not read, or left out whole
        out["raw"] = None
        if raw_for is not None and raw_for(hb.node):
            if isinstance(raw, msgspec.Raw):
                raw = json.loads(bytes(raw))
            out["raw"] = parse_raw(raw, {s.id for s in shards}, dropped)
    return out
