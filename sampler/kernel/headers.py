"""The kernel headers bcc compiles the programs against."""

from __future__ import annotations

import itertools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from sampler.backend_unavailable import BackendUnavailable

# A kernel tree of the few headers bcc's helpers include (bpf/include/).
BUNDLED_HEADERS = Path(__file__).resolve().parents[2] / "bpf"


def kernel_version_code(release: str) -> int:
    """LINUX_VERSION_CODE of a kernel release (`6.1.0-18-amd64`, `5.10.209`):
    what a real tree's generated version.h would say, sublevel capped at 255."""
    numbers = []
    for part in release.split("-", 1)[0].split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        numbers.append(int(digits) if digits else 0)
    major, minor, sub = (numbers + [0, 0, 0])[:3]
    return (major << 16) + (min(minor, 255) << 8) + min(sub, 255)


@dataclass(frozen=True)
class HeaderTree:
    """What bcc compiles against: its environment, extra flags, and a name for the log."""

    env: dict[str, str | None]  # None: unset while compiling
    cflags: list[str]
    name: str


INSTALLED = "installed"  # --kernel-headers installed: the distribution's, where bcc looks for them


def find_kernel_headers(configured: Path | str | None, release: str | None = None) -> HeaderTree:
    """The headers bcc compiles against, or BackendUnavailable.

    By default the few headers shipped in bpf/include/: the programs read no
    kernel struct through headers (offsets come from BTF), so no kernel's own
    are needed, and a machine without any loads the backend. Otherwise, as
    configured: a kernel tree (given to bcc as BCC_KERNEL_SOURCE), or
    `installed`: bcc's own search of /lib/modules/<release>/{build,source}
    (Debian splits its headers in two packages: both are needed).
    $BCC_KERNEL_SOURCE, set by the operator, is honoured as bcc would.
    """
    release = release or platform.release()
    if configured == INSTALLED:
        mod = Path("/lib/modules") / release
        if not ((mod / "build" / "include").is_dir() or (mod / "source" / "include").is_dir()):
            raise BackendUnavailable(
                f"no kernel headers installed for {release}: looked in {mod}/build and {mod}/source "
                "(install the distribution's linux-headers package, or leave --kernel-headers out for the bundled ones)"
            )
        return HeaderTree({"BCC_KERNEL_SOURCE": None}, [], f"the installed headers in {mod}")
    if configured is not None:
        tree = Path(configured)
        if not (tree / "include").is_dir():
            raise BackendUnavailable(f"no kernel headers in {tree} (configured): it has no include/ directory")
        return HeaderTree({"BCC_KERNEL_SOURCE": str(tree)}, [], f"the kernel tree {tree}")
    env = os.environ.get("BCC_KERNEL_SOURCE")
    if env:
        if not (Path(env) / "include").is_dir():
            raise BackendUnavailable(f"no kernel headers in BCC_KERNEL_SOURCE={env}: it has no include/ directory")
        return HeaderTree({}, [], f"the kernel tree {env} (BCC_KERNEL_SOURCE)")
    code = kernel_version_code(release)
    return HeaderTree({"BCC_KERNEL_SOURCE": str(BUNDLED_HEADERS)}, [f"-DLINUX_VERSION_CODE={code}"], "bundled headers")
