"""The host as the agent in a container must see it, not the container.

In a privileged pod with `hostPID` the agent shares the host's processes but
not its name (UTS namespace), its cgroup namespace (a private one shows other
processes' cgroup paths relative to the container's own cgroup, as
`/../../kubepods/...`) or its mounts. Pid 1 of `--proc-root` is the host's
init, so its namespaces are the host's. Where pid 1 cannot be inspected (a
protected init), pid 2, when it is the kernel's `kthreadd`, is in the
kernel's initial namespaces, which on a machine (not a node in a container)
are the host's:
- the host's name is read inside pid 1's UTS namespace, on a thread of its own
  (setns changes only the calling thread);
- the agent joins pid 1's cgroup namespace before it starts any thread, so
  every thread reads host cgroup paths; unprivileged, it cannot, and puts
  the paths it reads under its namespace's root instead (`cgroup_view`);
- disks come from pid 1's mount table, and statvfs reaches each mount point
  through `/proc/1/root` (see `machine.MachineGaugeReader`).

Outside a container pid 1's namespaces are the agent's own, and all of this
changes nothing. Each step that cannot be taken (not root, a test's fake
/proc, a kernel without the namespace) leaves the agent's own view and says so
once in the log.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
from pathlib import Path

from sampler.sources import cgroup_view

log = logging.getLogger(__name__)

CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000


def host_namespace(proc: Path, kind: str) -> Path | None:
    """The handle of the host's `kind` namespace, or None if none can be inspected."""
    for pid in ("1", "2"):
        if pid == "2":
            try:
                if (proc / "2" / "comm").read_text().strip() != "kthreadd":
                    continue
            except OSError:
                continue
        path = proc / pid / "ns" / kind
        try:
            os.readlink(path)
        except OSError:
            continue
        return path
    return None


def _same_namespace(proc: Path, kind: str) -> tuple[bool | None, Path | None]:
    """Whether the host's `kind` namespace is the agent's own (None if unknown), and its handle."""
    path = host_namespace(proc, kind)
    if path is None:
        return None, None
    try:
        return os.readlink(path) == os.readlink(f"/proc/self/ns/{kind}"), path
    except OSError:
        return None, None


def _setns(path: Path, nstype: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, nstype) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(path))
    finally:
        os.close(fd)


def host_name(proc: Path, host_root: Path | None = None) -> str:
    """The host's name: from the host's UTS namespace; where that cannot be
    inspected (the unprivileged pod: pid 1's namespaces need CAP_SYS_PTRACE,
    entering one CAP_SYS_ADMIN), the host's `/etc/hostname` through
    `host_root`; else the agent's own."""
    same, path = _same_namespace(proc, "uts")
    if same is None and host_root is not None and host_root != Path("/"):
        try:
            configured = (host_root / "etc" / "hostname").read_text().strip()
        except OSError:
            configured = ""
        if configured:
            return configured
    if same is not False or path is None:
        return socket.gethostname()
    result: list[str] = []

    def read() -> None:
        try:
            _setns(path, CLONE_NEWUTS)
            result.append(os.uname().nodename)
        except OSError as e:
            log.warning("host name not read from the host's UTS namespace (%s): using the container's", e)

    t = threading.Thread(target=read, name="host-uts")  # the thread ends in the host's namespace, harmlessly
    t.start()
    t.join()
    return result[0] if result else socket.gethostname()


def join_host_cgroup_namespace(proc: Path, host_root: Path | None = None) -> bool:
    """Enter the host's cgroup namespace; call before any thread starts (threads
    made later inherit it). Where it cannot be entered (no CAP_SYS_ADMIN, or
    pid 1's namespace cannot be inspected), the paths seen from the agent's
    own are put under its root as the host names it (`cgroup_view`). True if
    the agent now sees host cgroup paths."""
    same, path = _same_namespace(proc, "cgroup")
    if same:
        return True
    if same is not None and path is not None:
        if threading.active_count() > 1:
            log.warning("not joining the host's cgroup namespace: threads are already running")
            return False
        try:
            _setns(path, CLONE_NEWCGROUP)
        except OSError as e:
            log.info("cannot join the host's cgroup namespace (%s): %s", path, e)
        else:
            log.info("joined the host's cgroup namespace: cgroup paths are the host's")
            return True
    return cgroup_view.learn_namespace_roots(proc, cgroup_view.host_cgroup_root(host_root))
