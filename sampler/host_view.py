"""The host as the agent in a container must see it, not the container.

In a privileged pod with `hostPID` the agent shares the host's processes but
not its name (UTS namespace), its cgroup namespace (a private one shows other
processes' cgroup paths relative to the container's own cgroup, as
`/../../kubepods/...`) or its mounts. Pid 1 of `--proc-root` is the host's
init, so its namespaces are the host's:
- the host's name is read inside pid 1's UTS namespace, on a thread of its own
  (setns changes only the calling thread);
- the agent joins pid 1's cgroup namespace before it starts any thread, so
  every thread reads host cgroup paths;
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

log = logging.getLogger(__name__)

CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000


def _same_namespace(proc: Path, kind: str) -> bool | None:
    """Whether pid 1 of `proc` is in the agent's own `kind` namespace; None if unknown."""
    try:
        return os.readlink(proc / "1" / "ns" / kind) == os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return None


def _setns(path: Path, nstype: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, nstype) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(path))
    finally:
        os.close(fd)


def host_name(proc: Path) -> str:
    """The host's name: pid 1's UTS namespace, else the agent's own."""
    if _same_namespace(proc, "uts") is not False:
        return socket.gethostname()
    result: list[str] = []

    def read() -> None:
        try:
            _setns(proc / "1" / "ns" / "uts", CLONE_NEWUTS)
            result.append(os.uname().nodename)
        except OSError as e:
            log.warning("host name not read from pid 1's UTS namespace (%s): using the container's", e)

    t = threading.Thread(target=read, name="host-uts")  # the thread ends in the host's namespace, harmlessly
    t.start()
    t.join()
    return result[0] if result else socket.gethostname()


def join_host_cgroup_namespace(proc: Path) -> bool:
    """Enter pid 1's cgroup namespace; call before any thread starts (threads
    made later inherit it). True if the agent now sees host cgroup paths."""
    same = _same_namespace(proc, "cgroup")
    if same is None:
        return False
    if same:
        return True
    if threading.active_count() > 1:
        log.warning("not joining the host's cgroup namespace: threads are already running")
        return False
    try:
        _setns(proc / "1" / "ns" / "cgroup", CLONE_NEWCGROUP)
    except OSError as e:
        log.warning("cgroup paths are the container's, not the host's: cannot join pid 1's cgroup namespace: %s", e)
        return False
    log.info("joined the host's cgroup namespace: cgroup paths are the host's")
    return True
