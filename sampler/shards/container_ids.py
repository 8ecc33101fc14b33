"""Which container a process runs in, from its cgroup path.

Every container runtime a kubelet drives puts a container's processes in a
cgroup named after the container's id (64 hex digits), the id the kubelet
reports in a pod's `status.containerStatuses[].containerID`:

- containerd: `cri-containerd-<id>.scope` under the pod's slice (systemd
  driver: `.../kubepods-burstable-pod<uid>.slice/`), `<id>` under
  `/kubepods/burstable/pod<uid>/` (cgroupfs driver);
- CRI-O: `crio-<id>.scope` (systemd) or `crio-<id>` (cgroupfs); its
  monitor, conmon, in `crio-conmon-<id>.scope`, is not the container;
- Docker (cri-dockerd): `docker-<id>.scope` (systemd) or `<id>` (cgroupfs).

The same names on cgroup v1 (in each controller's hierarchy) and v2.
The id is looked for in any component of the path, the outermost one that
names a container winning: a path read in a private cgroup namespace starts
with `/..`, and a container may make cgroups of its own below its own, even
one named like another container (it cannot make one outside its own).
CRI-O's conmon (the container's monitor, not the container) names none.
"""

from __future__ import annotations

import re

_CONTAINER = re.compile(r"(?:cri-containerd-|crio-|docker-)?([0-9a-f]{64})(?:\.scope)?")
_SCHEMES = ("containerd://", "cri-o://", "docker://")


def from_cgroup_path(path: str) -> str | None:
    """The container id a cgroup path names, or None."""
    for part in path.split("/"):
        m = _CONTAINER.fullmatch(part)
        if m:
            return m.group(1)
    return None


def container_dir(path: str) -> str | None:
    """The cgroup path up to the container's own directory (below it, a
    container's cgroups of its own), or None where the path names none."""
    parts = path.split("/")
    for i, part in enumerate(parts):
        if _CONTAINER.fullmatch(part):
            return "/".join(parts[: i + 1])
    return None


def from_cgroup_paths(paths: list[str]) -> str | None:
    """The container id of a process from its /proc/<pid>/cgroup paths (v1's
    hierarchies agree; v2 has one)."""
    for path in paths:
        found = from_cgroup_path(path)
        if found is not None:
            return found
    return None


def from_status(container_id: str) -> str | None:
    """The id in a kubelet's `containerID` (`containerd://<id>`), or None."""
    for scheme in _SCHEMES:
        if container_id.startswith(scheme):
            bare = container_id[len(scheme) :]
            return bare if _CONTAINER.fullmatch(bare) and len(bare) == 64 else None
    return None
