"""task_slot read page by page (sampler/kernel/membership.py,
nonzero_bytes) against numpy's own flatnonzero over every byte; and the
walk's write of it racing the kernel's clearing of an exited member."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sampler.kernel.membership import PAGE, TaskSlots, nonzero_bytes


@settings(max_examples=200, deadline=None)
@given(length=st.integers(0, 3 * PAGE + 9), data=st.data())
def test_the_members_found_page_by_page_are_every_nonzero_byte(length: int, data: st.DataObject) -> None:
    shared = np.zeros(length, dtype=np.uint8)
    if length:
        at = data.draw(st.lists(st.integers(0, length - 1), max_size=40))
        shared[at] = data.draw(st.integers(1, 255))
    found = nonzero_bytes(shared)
    assert found.dtype.kind == "i" and found.tolist() == np.flatnonzero(shared).tolist()


def test_a_page_edge_and_the_tail_past_the_last_whole_page() -> None:
    shared = np.zeros(2 * PAGE + 5, dtype=np.uint8)
    at = [0, PAGE - 1, PAGE, 2 * PAGE - 1, 2 * PAGE, 2 * PAGE + 4]
    shared[at] = 1
    assert nonzero_bytes(shared).tolist() == at


class ExitsWhileRead(np.ndarray):
    """task_slot whose member `pid` exits (the kernel clears its slot) just
    after its `read`-th read by index, as a fork storm's children do."""

    pid: int
    read: int

    def __getitem__(self, index: Any) -> Any:
        got = super().__getitem__(index)
        if isinstance(index, np.ndarray) and index.dtype.kind == "i" and self.pid in index:
            self.read -= 1
            if self.read == 0:
                np.ndarray.__setitem__(self, self.pid, 0)
        return got


def test_a_member_that_exits_while_the_walk_writes_is_not_put_back() -> None:
    """The walk found pid 42 in slot 3, its slot already 3; the kernel clears
    it (an exit) after sync read it and before sync wrote the wanted slots:
    the slot stays clear (a write of every wanted pid put it back, unchecked)."""
    slots = np.zeros(PAGE, dtype=np.uint8).view(ExitsWhileRead)
    slots.pid, slots.read = 42, 2  # the first read of it: sync's snapshot of the members; the second: its compare
    np.ndarray.__setitem__(slots, 42, 3)
    members = TaskSlots.__new__(TaskSlots)
    members.task_slot, members.proc = slots, Path("/nonexistent")
    members.sync(SimpleNamespace(stats={42: SimpleNamespace(start_ticks=1)}), {42: 3})  # type: ignore[arg-type]
    assert slots.read == 0 and int(np.ndarray.__getitem__(slots, 42)) == 0


def test_a_member_whose_exit_is_under_way_is_not_put_back(tmp_path: Path) -> None:
    """The walk found pid 42; its exit began (PF_EXITING) and the kernel's exit
    tracepoint cleared its slot before sync wrote it, while /proc still says
    it runs ("R", the same start): sync clears the slot it wrote. Before, the
    dead pid kept its slot (the fork storm's `{24040, 30506} == {24040}`)."""
    from tests.fakeproc import pid_stat_line

    (tmp_path / "42").mkdir()
    running = pid_stat_line(42, start=1, flags=0x400000 | 0x4).replace(b") S ", b") R ")
    (tmp_path / "42" / "stat").write_bytes(running)
    slots = np.zeros(PAGE, dtype=np.uint8)  # cleared already: the exit tracepoint ran
    members = TaskSlots.__new__(TaskSlots)
    members.task_slot, members.proc = slots, tmp_path
    members.sync(SimpleNamespace(stats={42: SimpleNamespace(start_ticks=1)}), {42: 3})  # type: ignore[arg-type]
    assert int(slots[42]) == 0
    # Not exiting: it keeps the slot the walk gave it.
    (tmp_path / "42" / "stat").write_bytes(pid_stat_line(42, start=1).replace(b") S ", b") R "))
    assert members.sync(SimpleNamespace(stats={42: SimpleNamespace(start_ticks=1)}), {42: 3})  # type: ignore[arg-type]
    assert int(slots[42]) == 3
