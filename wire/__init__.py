"""The wire format: what may cross between an agent and the control plane,
declared once for both sides (docs/wire-format.md).

The bottom floor of the house: `sampler` and `controlplane` import it, and
it imports nothing of ours. Its modules: `limits` (the bounds), `checks`
(the field checks and `WireError`), `heartbeat` (the control plane's parsing
of registrations and heartbeats), `raw` (a window's raw samples, for the
live view) and `fit` (what the agent sends: the schema's structs made from its
figures, fit for the wire).
"""

from wire.checks import Dropped, Json, WireError, name, node_id
from wire.fit import dumps, encode, fit_gpus, fit_machine, fit_shards, keep_busiest, made, printable
from wire.heartbeat import (
    Decoded,
    decode_heartbeat,
    decode_registration,
    heartbeat_json,
    parse_heartbeat,
)
from wire.limits import (
                         MAX_BODY_BYTES,
                         MAX_BYTES,
                         MAX_CORES,
                         MAX_DISKS,
                         MAX_GPUS,
                         MAX_K8S_NAME,
                         MAX_NAME,
                         MAX_PGIDS,
                         MAX_QUOTA_CORES,
                         MAX_SHARDS,
                         MAX_TEXT,
                         NODE_ID,
)

__all__ = [
    "Decoded", "Dropped", "Json", "MAX_BODY_BYTES", "MAX_BYTES", "MAX_CORES", "MAX_DISKS", "MAX_GPUS",
    "MAX_K8S_NAME", "MAX_NAME", "MAX_PGIDS", "MAX_QUOTA_CORES", "MAX_SHARDS", "MAX_TEXT", "NODE_ID", "WireError",
    "decode_heartbeat", "decode_registration", "dumps", "encode", "fit_gpus", "fit_machine",
    "fit_shards", "heartbeat_json", "keep_busiest", "made", "name", "node_id", "parse_heartbeat", "printable",
]
