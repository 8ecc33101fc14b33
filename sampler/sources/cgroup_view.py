"""Cgroup paths as the host names them, from inside a cgroup namespace the
agent cannot leave.

In a private cgroup namespace (containerd gives every container one on
cgroup v2 nodes) `/proc/PID/cgroup` names each cgroup relative to the
agent's own: `/../../kubepods/...`. The privileged agent joins the host's
namespace (`host_view.join_host_cgroup_namespace`), but `setns` needs
CAP_SYS_ADMIN, which the unprivileged DaemonSet does not hold. There the
agent learns, once at start, where its namespace's root is in each
hierarchy of the host's tree (the host's `/sys/fs/cgroup`, seen through the
host's `/`: `host_cgroup_root`), and puts that in front of every path it reads:
- the kernel's `kthreadd` (pid 2) is in every hierarchy's root, so its path
  as the agent reads it is as many `..` as the agent's root is deep;
- the agent's root is the directory at that depth that holds the agent's
  own cgroup (`/proc/self/cgroup`, relative to the root) with the agent's
  pid (the host's pid: the pod shares the host's PID namespace) in it.

A hierarchy whose root cannot be found keeps the namespace's paths, and
the log says so once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
from pathlib import Path

from sampler.sources import procfs

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
MAX_DIRS = 100_000  # directories looked at per hierarchy, at most: a node has a few thousand


def host_cgroup_root(host_root: Path | None) -> Path:
    """The host's cgroup tree: under the host's / when the agent is given it
    (in a container, `/sys/fs/cgroup` is the runtime's own mount, rooted at
    the container's cgroup, and hides the host's that came with `/sys`)."""
    if host_root is not None and host_root != Path("/"):
        tree = host_root / "sys" / "fs" / "cgroup"
        with contextlib.suppress(OSError):
            if any(tree.iterdir()):
                return tree
    return CGROUP_ROOT


# Hierarchy ("ID:controllers") -> the host path of the agent's namespace root in it.
_roots: dict[bytes, str] = {}


def lines(data: bytes) -> list[tuple[bytes, bytes, str]]:
    """Each line of a `/proc/PID/cgroup`: hierarchy id, controllers, and the
    path as the host names it (the namespace's own where its root is unknown)."""
    out = []
    for hierarchy, controllers, path in procfs.parse_cgroup_lines(data):
        root = _roots.get(hierarchy + b":" + controllers)
        out.append((hierarchy, controllers, path if root is None else posixpath.normpath(root + path)))
    return out


def host_paths(data: bytes) -> list[str]:
    """The path of each hierarchy in a `/proc/PID/cgroup`, as the host names it."""
    return [path for _, _, path in lines(data)]


def unified(cgroup_root: Path = CGROUP_ROOT) -> bool:
    """Whether the host's tree is the unified hierarchy alone (v2): its root has `cgroup.controllers`."""
    return (cgroup_root / "cgroup.controllers").exists()


def hierarchy_dir(controllers: bytes, cgroup_root: Path = CGROUP_ROOT) -> Path | None:
    """Where a hierarchy is mounted: v2's tree at the root (or `unified/` beside
    v1's), a v1 hierarchy under its controllers' or its name's directory."""
    if controllers == b"":
        if unified(cgroup_root):
            return cgroup_root
        return cgroup_root / "unified" if (cgroup_root / "unified" / "cgroup.controllers").exists() else None
    text = controllers.decode("utf-8", "replace")
    names = [text.removeprefix("name=")] if text.startswith("name=") else [text, *text.split(",")]
    return next((cgroup_root / n for n in names if (cgroup_root / n).is_dir()), None)


def _holds(d: Path, pid: int) -> bool:
    try:
        return str(pid).encode() in procfs.read_bytes(d / "cgroup.procs").split()
    except OSError:
        return False


def _find_root(top: Path, depth: int, own: str, pid: int) -> str | None:
    """The directory `depth` below `top` whose `own` subdirectory holds `pid`."""
    level, looked = [top], 0
    for _ in range(depth):
        below = []
        for d in level:
            try:
                with os.scandir(d) as entries:
                    found = [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue
            below += found
            looked += len(found)
            if looked > MAX_DIRS:
                return None
        level = below
    found = [d for d in level if _holds(d / own.lstrip("/"), pid)]
    return "/" + str(found[0].relative_to(top)) if len(found) == 1 else None


def learn_namespace_roots(proc: Path, cgroup_root: Path = CGROUP_ROOT, pid: int | None = None) -> bool:
    """Find the agent's namespace root in each hierarchy where its view is
    private; True when every such hierarchy's root was found (or none is private)."""
    pid = os.getpid() if pid is None else pid
    try:
        if (proc / "2" / "comm").read_text().strip() != "kthreadd":
            return False
        kernel = {(h, c): p for h, c, p in procfs.parse_cgroup_lines(procfs.read_bytes(proc / "2" / "cgroup"))}
        own = {(h, c): p for h, c, p in procfs.parse_cgroup_lines(procfs.read_bytes(proc / str(pid) / "cgroup"))}
    except OSError:
        return False
    complete = True
    for (hierarchy, controllers), path in kernel.items():
        depth = len([p for p in path.split("/") if p == ".."])
        if depth == 0 or (hierarchy, controllers) not in own:
            continue  # the host's view already, or a hierarchy the agent is not in
        top = hierarchy_dir(controllers, cgroup_root)
        root = None if top is None else _find_root(top, depth, own[(hierarchy, controllers)], pid)
        name = f"{hierarchy.decode()}:{controllers.decode()}"
        if root is None:
            complete = False
            log.warning("cgroup hierarchy %s: the agent's cgroup namespace root was not found in %s: "
                        "its cgroup paths are the container's", name, top)  # fmt: skip
            continue
        _roots[hierarchy + b":" + controllers] = root
        log.info("cgroup hierarchy %s: paths seen from the container are put under %s, as the host names them",
                 name, root)  # fmt: skip
    return complete


def forget_namespace_roots() -> None:
    """Back to paths as read (tests)."""
    _roots.clear()



def unified_ids_below(path: str, cgroup_root: Path = CGROUP_ROOT, limit: int = MAX_DIRS) -> dict[str, int] | None:
    """The unified hierarchy's cgroup at a host path and every one below it,
    each by the id the kernel gives it (bpf_get_current_cgroup_id: its
    directory's inode number); empty where the tree is not v2 alone
    (cgroup.controllers at the root) or the path is gone; None where there
    are more than `limit` (whoever runs in the cgroup can make more below it)."""
    if not unified(cgroup_root):
        return {}
    out: dict[str, int] = {}
    for where, dirs, _files in os.walk(cgroup_root / path.lstrip("/")):
        try:
            out[posixpath.normpath("/" + str(Path(where).relative_to(cgroup_root)))] = os.stat(where).st_ino
        except OSError:
            continue  # removed while walked
        if len(out) > limit:
            return None
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(where, d))]
    return out
