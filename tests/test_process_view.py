"""Which processes a window reads (sampler/window/process_view.py): the whole
of /proc, or only what the kernel says matters, and the periodic walk's
check of the kernel's membership. A fake /proc and a stand-in for the
kernel's report: the real ones are in test_kernel_groups_run.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from sampler.kernel.groups_run import GroupsRun
from sampler.shards.selectors import Selector
from sampler.window.process_view import CHECK_ROUNDS, ProcessView
from tests.fakeproc import FakeClock, FakeProc


class KernelReport:
    """What the kernel backend would say: the groups that ran since the last
    call (taken), and the processes it counts now."""

    def __init__(self) -> None:
        self.ticks: dict[int, int] = {}
        self.complete = True
        self.following = True
        self.members: set[int] = set()
        self.members_later: set[int] | None = None  # what later reads say (the tick moved one meanwhile)
        self.later_from_read = 2  # the read from which they say it
        self.reads = 0

    def groups_run(self) -> GroupsRun:
        ticks, self.ticks = self.ticks, {}
        return GroupsRun(ticks, self.complete, self.following, 0.01)

    def member_pids(self) -> set[int]:
        self.reads += 1
        if self.members_later is not None and self.reads >= self.later_from_read:
            return set(self.members_later)
        return set(self.members)


@pytest.fixture
def node(tmp_path: Path) -> tuple[FakeProc, KernelReport, FakeClock, ProcessView]:
    proc = FakeProc(tmp_path / "proc")
    proc.add(100, comm="engine")  # a watched group: its leader and a worker
    proc.add(101, comm="engine", pgrp=100)
    proc.add(200, comm="busy")  # a group that runs, not watched
    for pid in range(300, 340):  # a crowd that sleeps
        proc.add(pid, comm="sleeper", pgrp=300)
    kernel, clock = KernelReport(), FakeClock()
    sleeps: list[float] = []
    view = ProcessView(proc.root, cast(Any, kernel), clock, sleeps.append)
    view.sleeps = sleeps  # type: ignore[attr-defined]
    return proc, kernel, clock, view


def test_between_walks_a_window_reads_only_what_the_kernel_names(node: tuple[Any, ...]) -> None:
    proc, kernel, clock, view = node
    table, ran = view.table(by_group_only=True)
    assert view.walks == 1 and len(table.stats) == 43 and ran == {}
    view.watched({100})
    kernel.members = {101}
    kernel.ticks = {200: 7}
    clock.advance(5)
    table, ran = view.table(by_group_only=True, named=[301])
    # The kernel's members, the groups that ran, the watched groups' leaders and the named pids: no crowd.
    assert sorted(table.stats) == [100, 101, 200, 301] and ran == {200: 7}
    assert view.walks == 1
    assert sorted(table.resolve(Selector.parse("pgid:100"))) == [100, 101]


@pytest.mark.parametrize("why", ["no report", "not by group", "not following", "map full", "periodic"])
def test_the_whole_of_proc_is_walked_where_the_kernel_cannot_say(node: tuple[Any, ...], why: str) -> None:
    proc, kernel, clock, view = node
    view.table(by_group_only=True)
    clock.advance(5)
    by_group = why != "not by group"
    kernel.following = why != "not following"
    kernel.complete = why != "map full"
    if why == "no report":
        kernel.groups_run = lambda: None
    if why == "periodic":
        clock.advance(view.full_walk_every)
    table, _ = view.table(by_group_only=by_group)
    assert view.walks == 2 and len(table.stats) == 43


def periodic_walk(view: ProcessView, clock: FakeClock) -> int:
    """The next window, when the periodic walk is due: the corrections it counted."""
    clock.advance(view.full_walk_every)
    view.table(by_group_only=True)
    return view.corrections


def watching_group_100(view: ProcessView) -> None:
    view.table(by_group_only=True)
    view.watched({100})


def test_the_periodic_walk_counts_what_the_kernel_placed_wrong(node: tuple[Any, ...]) -> None:
    proc, kernel, clock, view = node
    watching_group_100(view)
    kernel.members = {100, 101}
    assert periodic_walk(view, clock) == 0  # agreed
    # The kernel missed a member (moved into the group while it slept), and
    # kept one that left (it never ran since): two to correct.
    proc.add(102, comm="engine", pgrp=100)
    proc.set(101, comm="engine", pgrp=200)
    assert periodic_walk(view, clock) == 2
    # Counted only after every round of two ticks has passed without the kernel agreeing.
    assert view.sleeps == [0.02] * CHECK_ROUNDS


def test_a_process_the_tick_follows_during_the_check_is_not_a_correction(node: tuple[Any, ...]) -> None:
    proc, kernel, clock, view = node
    watching_group_100(view)
    proc.set(101, comm="engine", pgrp=200)  # left the group just before the walk
    kernel.members = {100, 101}
    kernel.members_later = {100}  # the tick has followed it a tick later
    assert periodic_walk(view, clock) == 0


def test_a_process_the_tick_follows_only_rounds_later_is_not_a_correction(node: tuple[Any, ...]) -> None:
    """A process that moved just before it was read, and waits for a CPU on a
    crowded node: the tick follows it several ticks later (CI's 2-core
    machine, four burners of the leave-and-join storm)."""
    proc, kernel, clock, view = node
    watching_group_100(view)
    proc.set(101, comm="engine", pgrp=200)
    kernel.members = {100, 101}
    kernel.members_later, kernel.later_from_read = {100}, CHECK_ROUNDS
    assert periodic_walk(view, clock) == 0
    assert len(view.sleeps) == CHECK_ROUNDS - 1


def test_a_process_that_moves_again_during_the_check_is_not_a_correction(node: tuple[Any, ...]) -> None:
    proc, kernel, clock, view = node
    watching_group_100(view)
    kernel.members = {100}  # 101 left, and the tick has not seen it yet
    proc.set(101, comm="engine", pgrp=200)
    original = view._sleep

    def rejoins(seconds: float) -> None:
        proc.set(101, comm="engine", pgrp=100)
        original(seconds)

    view._sleep = rejoins
    assert periodic_walk(view, clock) == 0


def test_a_process_that_exits_during_the_check_is_not_a_correction(node: tuple[Any, ...]) -> None:
    proc, kernel, clock, view = node
    watching_group_100(view)
    kernel.members = {100}  # 101 exited: the kernel cleared it; the walk still saw it
    original = view._sleep

    def exits(seconds: float) -> None:
        if (proc.root / "101").exists():
            proc.remove(101)
        original(seconds)

    view._sleep = exits
    assert periodic_walk(view, clock) == 0


POD = "/kubepods.slice/kubepods-pod1.slice"
ENGINE, SIDECAR = "ab" * 32, "cd" * 32


@pytest.fixture
def pods_node(tmp_path: Path) -> tuple[FakeProc, Path, ProcessView]:
    """A node of two containers in a pod, a service's crowd, and cgroup v2:
    processes in the cgroups' `cgroup.procs` as in /proc."""
    proc, tree = FakeProc(tmp_path / "proc"), tmp_path / "cgroup"
    (tree / "system.slice" / "crowd.service").mkdir(parents=True)
    (tree / "cgroup.controllers").write_text("cpu memory\n")
    placed = {f"{POD}/cri-containerd-{ENGINE}.scope": [100, 101], f"{POD}/cri-containerd-{ENGINE}.scope/inner": [102],
              f"{POD}/cri-containerd-{SIDECAR}.scope": [200], "/system.slice/crowd.service": list(range(300, 340)),
              "/": [1]}  # fmt: skip
    for path, pids in placed.items():
        d = tree / path.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.procs").write_text("".join(f"{pid}\n" for pid in pids))
        for pid in pids:
            proc.add(pid, comm="p", cgroup=path, pgrp=pid)
    # A container's cgroups of its own, one named like a container: never looked in.
    (tree / POD.lstrip("/") / f"cri-containerd-{SIDECAR}.scope" / f"cri-containerd-{'ef' * 32}.scope").mkdir()
    view = ProcessView(proc.root, cast(Any, KernelReport()), FakeClock(), lambda s: None, tree)
    return proc, tree, view


def test_between_walks_a_window_reads_only_the_watched_cgroups_processes(pods_node: tuple[Any, ...]) -> None:
    proc, tree, view = pods_node
    assert len(view.table(False, by_cgroup_only=True, containers={ENGINE})[0].stats) == 45  # the first: a walk
    table, _ = view.table(False, by_cgroup_only=True, containers={ENGINE, "99" * 32}, named=[301])
    assert sorted(table.stats) == [100, 101, 102, 301] and view.walks == 1
    assert view.containers_on_node() == {ENGINE, SIDECAR}  # the one named below a container's own is not
    table, _ = view.table(False, by_cgroup_only=True, cgroups=[POD])
    assert sorted(table.stats) == [100, 101, 102, 200] and view.walks == 1
    # A process the kernel still counts, moved out of the watched cgroups
    # unfollowed: read where it is now, so that the kernel's sync takes it out.
    view._shards.members = {305}
    table, _ = view.table(False, by_cgroup_only=True, containers={ENGINE})
    assert sorted(table.stats) == [100, 101, 102, 305] and table.cgroups(305) == ["/system.slice/crowd.service"]


@pytest.mark.parametrize("why", ["v1", "too many cgroups", "periodic", "neither"])
def test_the_whole_of_proc_is_walked_where_the_cgroups_cannot_say(pods_node: tuple[Any, ...], why: str) -> None:
    proc, tree, view = pods_node
    view.table(False, by_cgroup_only=True, containers={ENGINE})
    if why == "v1":
        (tree / "cgroup.controllers").unlink()
    if why == "too many cgroups":
        view.cgroup_dirs_max = 4
    if why == "periodic":
        view._clock.advance(view.full_walk_every)
    table, _ = view.table(False, by_cgroup_only=why != "neither", containers={ENGINE})
    assert view.walks == 2 and len(table.stats) == 45
