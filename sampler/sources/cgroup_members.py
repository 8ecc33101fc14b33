"""Which processes the watched cgroups hold, read from the cgroups
themselves: what spares a window with `cgroup:`, `containers:` and `k8s:`
selectors a walk of /proc (sampler/window/process_view.py).

On the unified hierarchy (cgroup v2 alone) a cgroup's `cgroup.procs` lists
the processes in it; a watched path's processes are those of its directory
and every one below it. A container's directory is found by its name
(sampler/shards/container_ids.py), in a scan of the tree that does not
descend into containers: below a container's own directory are only
cgroups the container made, as many as it likes, and a tenant must not
make the scan dearer. The scan also lists every container on the node, so
that a container no pod names yet is still met without a walk (the
kubelet's poll, sampler/shards/kubelet.py).

On a v1 (or hybrid) tree a process has a cgroup in each hierarchy, and a
selector may name any of them: there the walk decides.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from sampler.shards import container_ids
from sampler.sources import procfs
from sampler.sources.cgroup_view import CGROUP_ROOT

# Directories read per window, at most: a Kubernetes node has a few hundred
# cgroups outside its containers (a pod's slice and its containers' scopes),
# a few thousand with many pods. Past it (a tenant with a delegated subtree
# of its own, outside any container, can make more) the window walks /proc.
MAX_DIRS = 10_000


def procs_below(paths: list[str], cgroup_root: Path = CGROUP_ROOT, limit: int = MAX_DIRS) -> set[int] | None:
    """The processes in the cgroups at these host paths and in every cgroup
    below them; a path that is gone holds none; None past `limit`
    directories in all."""
    out: set[int] = set()
    looked = 0
    for path in paths:
        for where, dirs, _files in os.walk(cgroup_root / path.lstrip("/")):
            looked += 1
            if looked > limit:
                return None
            # Removed while walked, or a threaded cgroup's (its domain lists the processes).
            with contextlib.suppress(OSError, ValueError):
                out.update(int(pid) for pid in procfs.read_bytes(os.path.join(where, "cgroup.procs")).split())
            dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(where, d))]
    return out


def container_dirs(cgroup_root: Path = CGROUP_ROOT, limit: int = MAX_DIRS) -> dict[str, str] | None:
    """Every container's own cgroup on the node, by the container's id, as
    a host path; None past `limit` directories outside containers."""
    out: dict[str, str] = {}
    for looked, (where, dirs, _files) in enumerate(os.walk(cgroup_root), 1):
        if looked > limit:
            return None
        keep = []
        for d in dirs:
            if (cid := container_ids.from_cgroup_path(d)) is not None:
                out.setdefault(cid, "/" + os.path.relpath(os.path.join(where, d), cgroup_root))
            elif not os.path.islink(os.path.join(where, d)):
                keep.append(d)
        dirs[:] = keep
    return out
