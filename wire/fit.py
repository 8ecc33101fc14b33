"""What the agent sends, made fit for the wire: the schema's structs made
from its figures (`made`), text from the machine (process names, mount
points, GPU names) made printable by escaping, lists trimmed to their
limits, most important first, with a count of what was left out. Nothing
is edited in place: each step makes new structs."""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import msgspec
import msgspec.inspect
import msgspec.structs

from wire.checks import Json
from wire.limits import MAX_DISKS, MAX_GPUS, MAX_NAME, MAX_PGIDS, MAX_SHARDS, MAX_TEXT
from wire.schema import Disk, Gpu, Machine, Shard, json_values


def printable(text: str | None, limit: int = MAX_TEXT) -> str | None:
    """Machine text as it may cross the wire: every character that is not
    printable escaped as Python writes it (a tab as `\\t`, a non-breaking
    space as `\\xa0`), never dropped, so two names that differ still differ;
    cut to `limit` characters with an ellipsis. None for nothing to say."""
    if not text:
        return None
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


T = TypeVar("T")


def keep_busiest(shards: Sequence[T], most: int, cores: Callable[[T], float | None]) -> tuple[Sequence[T], int]:
    """The `most` busiest shards by their mean cores (one not measured
    counts as idle), and how many were left out: the one rule both the
    agent (the wire's limit) and the control plane (`--max-shards`) trim by.
    Fewer than `most` are kept as they came, in their order."""
    if len(shards) <= most:
        return shards, 0
    return sorted(shards, key=lambda s: -(cores(s) or 0.0))[:most], len(shards) - most


S = TypeVar("S", bound=msgspec.Struct)
_Convert = Callable[[Any], Any]


def made(cls: type[S], fields: Mapping[str, Any]) -> S:
    """One of the schema's structs from the agent's figures, keyed as on the
    wire (nested objects and lists too): its free text made printable and cut
    to the length the schema declares for it (empty text is absent; a
    required one is `?`). Bounds are not checked here: what was measured is
    sent as measured, and the control plane judges it (a bad entry costs that
    entry alone there, named in the answer's `dropped`). A key the schema
    does not declare is a bug of ours, raised as TypeError."""
    plan = _plan(cls)
    kwargs = {}
    for key, value in fields.items():
        try:
            name, convert = plan[key]
        except KeyError:
            raise TypeError(f"{cls.__name__} has no field {key!r}") from None
        kwargs[name] = convert(value)
    return cls(**kwargs)


@functools.cache
def _plan(cls: type[msgspec.Struct]) -> dict[str, tuple[str, _Convert]]:
    """For each key of `cls` on the wire: its attribute, and how its value is made."""
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    return {f.encode_name: (f.name, _converter(f.type, f.required)) for f in info.fields}


def _converter(t: msgspec.inspect.Type, required: bool) -> _Convert:
    if isinstance(t, msgspec.inspect.Metadata):
        if isinstance(t.type, msgspec.inspect.StrType) and (t.extra or {}).get("text"):
            limit = t.type.max_length or MAX_TEXT
            return (lambda v: printable(v, limit) or "?") if required else (lambda v: printable(v, limit))
        t = t.type
    if isinstance(t, msgspec.inspect.UnionType):
        [inner] = [u for u in t.types if not isinstance(u, msgspec.inspect.NoneType)]
        some = _converter(inner, required)
        return lambda v: None if v is None else some(v)
    if isinstance(t, msgspec.inspect.StructType):
        cls = t.cls
        return lambda v: v if isinstance(v, cls) else made(cls, v)
    if isinstance(t, msgspec.inspect.VarTupleType | msgspec.inspect.ListType):
        item = _converter(t.item_type, True)
        return lambda v: tuple(item(x) for x in v)
    if isinstance(t, msgspec.inspect.DictType):
        value = _converter(t.value_type, True)
        return lambda v: {k: value(x) for k, x in v.items()}
    return lambda v: v


def _fit_disks(disks: Sequence[Disk] | None) -> tuple[tuple[Disk, ...] | None, int | None]:
    """The largest `MAX_DISKS` disks, and how many were left out (None: none)."""
    if disks is None or len(disks) <= MAX_DISKS:
        return (None if disks is None else tuple(disks)), None
    return tuple(sorted(disks, key=lambda d: -d.bytes)[:MAX_DISKS]), len(disks) - MAX_DISKS


def fit_machine(fields: Mapping[str, Any]) -> Machine:
    """The machine's figures, its disks within the wire's limit (`disks_left_out`)."""
    machine = made(Machine, fields)
    disks, left_out = _fit_disks(machine.disks)
    return machine if left_out is None else msgspec.structs.replace(machine, disks=disks, disks_left_out=left_out)


def fit_gpus(gpus: Iterable[Mapping[str, Any]]) -> tuple[Gpu, ...]:
    """The first `MAX_GPUS` cards, their text made printable."""
    return tuple(made(Gpu, g) for g in itertools.islice(gpus, MAX_GPUS))


def fit_shards(shards: Sequence[tuple[Shard, T]]) -> tuple[list[tuple[Shard, T]], int | None]:
    """The busiest `MAX_SHARDS` shards, each with what the caller keeps beside
    it, their ids unique (two names cut to one length may meet: each shard is
    kept, the later one's id suffixed `~N`), their pgids within the limit; and
    how many were left out (None: none)."""
    kept, left_out = keep_busiest(shards, MAX_SHARDS, _mean_cores)
    out, seen = [], set()
    for shard, beside in kept:
        sid = base = shard.id
        n = 0
        while sid in seen:
            n += 1
            sid = base[: MAX_NAME - len(f"~{n}")] + f"~{n}"
        seen.add(sid)
        changes: dict[str, Any] = {}
        if sid != shard.id:
            changes["id"] = sid
        if shard.pgids is not None and len(shard.pgids) > MAX_PGIDS:
            changes["pgids"] = shard.pgids[:MAX_PGIDS]
        out.append((msgspec.structs.replace(shard, **changes) if changes else shard, beside))
    return out, left_out or None


def _mean_cores(pair: tuple[Shard, Any]) -> float | None:
    return None if pair[0].cpu_cores is None else pair[0].cpu_cores.mean


def encode(body: msgspec.Struct) -> bytes:
    """A struct of the schema as its JSON body (`json_values`)."""
    return _ENCODER.encode(json_values(body))


_ENCODER = msgspec.json.Encoder()


def dumps(body: Json) -> bytes:
    """JSON values as a body (tests and tools: the agent sends structs, `encode`)."""
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
