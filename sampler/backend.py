"""Choosing the backend that counts engines' CPU time.

`proc` reads /proc. `bpf` (counting on-CPU time in the kernel) is not part of
this version yet: asked for explicitly it is refused with that reason, and
`auto` falls back to /proc saying why, as it will for a kernel backend that
does not load.
"""

from __future__ import annotations

from dataclasses import dataclass

CHOICES = ("auto", "bpf", "proc")


class BackendUnavailable(Exception):
    """The backend asked for cannot run here; the message says why."""


@dataclass(frozen=True)
class BackendChoice:
    name: str  # the backend in use: "bpf" or "proc"
    reason: str | None  # why the kernel backend is not in use, when it is not


def choose_backend(asked: str) -> BackendChoice:
    if asked not in CHOICES:
        raise ValueError(f"backend {asked!r}: expected one of {', '.join(CHOICES)}")
    if asked == "proc":
        return BackendChoice("proc", "asked for proc")
    reason = "kernel backend not built into this version of nodesampler"
    if asked == "bpf":
        raise BackendUnavailable(reason)
    return BackendChoice("proc", reason)
