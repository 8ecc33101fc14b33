"""The wire's bounds: how much of each thing a body may carry, in one place
(docs/wire-format.md, "Limits")."""

from __future__ import annotations

import re

MAX_BODY_BYTES = 512 * 1024
MAX_SHARDS = 256
MAX_GPUS = 64
MAX_GPU_INSTANCES = 8  # MIG devices a card has at most (7 on A100 and H100)
MAX_DISKS = 128
MAX_PGIDS = 1024
MAX_NAME = 128  # model, replica and shard names: free printable text
MAX_TEXT = 512
MAX_K8S_NAME = 253  # a pod's name; namespaces and containers are 63
MAX_BYTES = 2**62  # an exabyte and more; keeps every count an exact int64
MAX_CORES = 100_000.0
# A CFS quota is a setting, not a use: the kernel takes up to 2^44-1 us of quota
# per period of at least 1 ms, "unlimited" written as a number (17,592,186,044 cores).
MAX_QUOTA_CORES = 2**44 / 1000

NODE_ID = re.compile(r"[A-Za-z0-9._-]{1,253}")
