"""Memory order between the kernel's programs and the agent where they share
memory (the BPF_F_MMAPABLE arrays: the sample ring, `cpu_run`, `slot_ns`,
`sample_config`), read and written at the same time on different CPUs.

A writer publishes under a sequence word or a count: it writes the word (odd,
for a sequence), then the data, then the word again; a reader reads the word,
then the data, then the word again, and keeps what did not move. That holds
only if each side's accesses reach memory in that order. x86-64 keeps loads in
order with loads and stores with stores (TSO), so the source's order is the
CPU's and no instruction is needed. arm64 may make a CPU's stores visible in
another order and perform a load before an earlier one: a reader could see a
new count and old data. Each side then needs a fence between its steps.

- The programs (bpf/sched_groups.bpf.c, `ordered_add`, `fence`): BPF has no
  fence instruction (load-acquire and store-release came in 6.15), but a
  fetching atomic is fully ordered in every JIT (arm64's SWPAL, or an LL/SC
  loop ended by DMB ISH; x86's XCHG), where a plain atomic add is not
  (arm64's STADD orders nothing). The programs exchange, where a fetching
  add would do as well: bcc 0.32 and later
  compile for BPF's CPU v1, where LLVM 20 and later end the compile on a
  fetching add. Fetching atomics came in 5.12 (`FETCH_ATOMICS`); on
  an older kernel the program keeps the source's order, which is enough on
  x86 alone, and `check_order` refuses the backend on any other CPU.
- The agent (`fence`): Python emits no fence of its own. libatomic (GCC's
  runtime, Debian's libatomic1) exports C11's `atomic_thread_fence` as a
  function, called through ctypes; it is a full fence (arm64: DMB ISH). On
  x86 `fence` calls nothing: the order of the source's reads is already the
  CPU's, and a call would cost a microsecond for nothing.
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Callable

from sampler.backend_unavailable import BackendUnavailable
from sampler.kernel.headers import kernel_version_code

# Loads kept in order with loads, stores with stores: the CPUs where the
# source's order is the memory's (uname -m's names for them).
IN_ORDER_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686"})
FETCH_ATOMICS_FROM = (5 << 16) + (12 << 8)  # BPF_FETCH: the kernel's 5.12
MEMORY_ORDER_SEQ_CST = 5  # C11's memory_order_seq_cst, as <stdatomic.h> numbers it


def in_order(machine: str | None = None) -> bool:
    """Whether this CPU keeps loads and stores in program order among their own kind."""
    return (machine or platform.machine()) in IN_ORDER_MACHINES


def libatomic_fence() -> Callable[[], None]:
    """libatomic's atomic_thread_fence, seq_cst: a full fence, one ctypes call."""
    try:
        library = ctypes.CDLL("libatomic.so.1")
    except OSError as e:
        raise BackendUnavailable(
            f"libatomic is not installed ({e}); install libatomic1: on {platform.machine()}, the agent orders its "
            "reads of the kernel's shared memory with its fence") from None  # fmt: skip
    thread_fence = library.atomic_thread_fence
    thread_fence.argtypes = [ctypes.c_int]
    thread_fence.restype = None

    def fence() -> None:
        thread_fence(MEMORY_ORDER_SEQ_CST)

    return fence


def _no_fence() -> None:
    """x86: the reads are performed in the source's order already."""


def reader_fence(machine: str | None = None) -> Callable[[], None]:
    """What the agent calls between a sequence word's read and the data's, and
    between the data's and the word's second read (and the same between its
    own writes to `sample_config`)."""
    return _no_fence if in_order(machine) else libatomic_fence()


def program_flags(release: str | None = None, machine: str | None = None) -> list[str]:
    """The programs' cflags for their side: fully ordered atomics where the
    kernel has them; none on an older kernel, where only an x86 CPU keeps the
    order (anything else: BackendUnavailable, said before compiling)."""
    release = release or platform.release()
    if kernel_version_code(release) >= FETCH_ATOMICS_FROM:
        return ["-DFETCH_ATOMICS=1"]
    if not in_order(machine):
        raise BackendUnavailable(
            f"kernel {release} is older than 5.12: its BPF has no fully ordered atomic, which the kernel's "
            f"programs need to publish their counters in order on {machine or platform.machine()}")  # fmt: skip
    return []
