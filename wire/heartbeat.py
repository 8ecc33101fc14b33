"""The control plane's side of the wire: a registration or a heartbeat,
accepted only as wire/schema.py declares it.

Every field is checked for type, range, finiteness, length and characters,
every list for its length. Identity, structure and the machine's numbers
are strict: the first problem is raised as `WireError(field, reason)`,
answered 400. One bad entry of a list (a shard, a disk, a GPU) costs that
entry alone: it is left out, and named with its reason in the `dropped`
list the parser is given.

A body is decoded straight into the schema's structs (msgspec); only one
that does not fit is read again to say why (wire/explain.py). The control
plane holds and reads the structs themselves (`decode_heartbeat`), frozen:
nothing edits a heartbeat on its way. `parse_heartbeat` gives the same as
JSON values, keyed as on the wire.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import msgspec
import msgspec.structs

from wire.checks import Dropped, Json, WireError, obj
from wire.explain import checked
from wire.hindsight import SpanRequest, parse_piece
from wire.limits import MAX_BODY_BYTES
from wire.raw import parse_raw
from wire.schema import Heartbeat, Registration, json_values

S = TypeVar("S", Heartbeat, Registration)

_NO_BLOCK = msgspec.Raw()


class _ArrivingHeartbeat(Heartbeat, kw_only=True, frozen=True):
    """A heartbeat as it is decoded: its blocks as `msgspec.Raw`, absent an
    empty one. msgspec reads no `Raw` within a union (`Raw | None`, as the
    schema declares them for the agent that writes them): every body that
    carried a raw block or a hindsight piece failed the fast path and was
    read again by the slow one (bench/abuse_control_plane.py's hindsight
    flood: 45% of the control plane's time in it)."""

    raw: msgspec.Raw = _NO_BLOCK
    hindsight: msgspec.Raw = _NO_BLOCK


_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {
    Heartbeat: msgspec.json.Decoder(_ArrivingHeartbeat),
    Registration: msgspec.json.Decoder(Registration),
}
_HEARTBEAT_FIELDS = tuple(f for f in Heartbeat.__struct_fields__ if f not in ("raw", "hindsight"))


def _block(value: msgspec.Raw) -> msgspec.Raw | None:
    """A block that came (None: absent, or `null`)."""
    return None if len(value) == 0 or (len(value) == 4 and bytes(value) == b"null") else value


def _decoded(data: bytes, kind: type[S], dropped: Dropped | None) -> tuple[S, Any, Any]:
    """The body as `kind`, its raw block and its hindsight piece: the
    struct's undecoded blocks, or JSON values when the slow path read them."""
    if len(data) > MAX_BODY_BYTES:
        raise WireError("body", f"larger than {MAX_BODY_BYTES} bytes")
    try:
        body = _DECODERS[kind].decode(data)
    except msgspec.DecodeError:  # ValidationError is one: not the schema's, or not JSON to msgspec
        return explained(data, kind, dropped)
    if not isinstance(body, _ArrivingHeartbeat):
        return body, None, None
    # The schema's own struct, without its blocks (a heartbeat is held as the schema's, and equal to one).
    heartbeat = Heartbeat(**{f: getattr(body, f) for f in _HEARTBEAT_FIELDS})
    return heartbeat, _block(body.raw), _block(body.hindsight)  # type: ignore[return-value]


@functools.cache
def _type_info(kind: type) -> msgspec.inspect.Type:
    """The schema as msgspec describes it: made once (it was 20% of a slow-path read)."""
    return msgspec.inspect.type_info(kind)


def explained(data: bytes, kind: type[S], dropped: Dropped | None) -> tuple[S, Any, Any]:
    """The slow path: the body read with `json` and walked against the
    schema, naming the first problem or leaving bad entries out."""
    try:
        # NaN and Infinity are not JSON, but Python writes them: read as floats,
        # they fail the range check of the field they are in, which names it
        # (and costs only that entry when it is one of a list's).
        value = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise WireError("body", f"not JSON: {str(e)[:120]}") from None
    value = checked(obj(value, "body"), _type_info(kind), "", dropped)
    raw, piece = value.pop("raw", None), value.pop("hindsight", None)
    try:
        return msgspec.convert(value, kind), raw, piece
    except msgspec.ValidationError as e:  # the explainer passed what the schema refuses: say it as msgspec does
        raise WireError("body", str(e)[:200]) from None


def decode_registration(data: bytes, dropped: Dropped | None = None) -> Registration:
    registration, _, _ = _decoded(data, Registration, dropped)
    return registration


class Decoded(NamedTuple):
    """A checked heartbeat, and its raw samples apart."""

    heartbeat: Heartbeat  # its shards' ids unique; its `raw` None
    raw_came: bool  # the body had a raw block, read or not
    raw: Json | None  # the checked raw samples (wire/raw.py) of a node watched live; else None
    # The checked piece (wire/hindsight.py) of the span asked of the node; else None.
    hindsight: Json | None = None
    hindsight_came: bool = False  # the body had a piece, read or not


def decode_heartbeat(data: bytes, dropped: Dropped | None = None,
                     raw_for: Callable[[str], bool] | None = None,
                     span_for: Callable[[str], SpanRequest | None] | None = None) -> Decoded:  # fmt: skip
    """A heartbeat, checked. Its raw samples are read only for a node
    `raw_for` says is watched live, and its hindsight piece only for a node
    `span_for` names a span asked of; for any other they are not read."""
    hb, raw, piece = _decoded(data, Heartbeat, dropped)
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
        shards = tuple(first.values())
    if shards is not hb.shards or hb.raw is not None or hb.hindsight is not None:
        hb = msgspec.structs.replace(hb, shards=shards, raw=None, hindsight=None)
    checked_raw = None
    if raw is not None and raw_for is not None and raw_for(hb.node):  # None when absent, or left out whole
        if isinstance(raw, msgspec.Raw):
            raw = json.loads(bytes(raw))
        checked_raw = parse_raw(raw, {s.id for s in shards}, dropped)
    checked_piece = None
    if piece is not None and span_for is not None and (asked := span_for(hb.node)) is not None:
        if isinstance(piece, msgspec.Raw):
            piece = json.loads(bytes(piece))
        checked_piece = parse_piece(piece, asked, dropped)
    return Decoded(hb, raw is not None, checked_raw, checked_piece, piece is not None)


def heartbeat_json(hb: Heartbeat) -> Json:
    """A heartbeat as JSON values, keyed as on the wire (`shards` always there,
    and the other keys the summary always has, `null` when not measured)."""
    return json_values(hb)


def parse_heartbeat(data: bytes, dropped: Dropped | None = None,
                    raw_for: Callable[[str], bool] | None = None) -> Json:  # fmt: skip
    """`decode_heartbeat` as JSON values: `raw` is there when the body had
    one, None when it was not read (or was left out whole)."""
    decoded = decode_heartbeat(data, dropped, raw_for)
    out = heartbeat_json(decoded.heartbeat)
    if decoded.raw_came:
        out["raw"] = decoded.raw
    return out
