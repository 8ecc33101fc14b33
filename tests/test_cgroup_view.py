"""Cgroup paths as the host names them, from a private cgroup namespace the
agent cannot leave (the unprivileged pod): fake /proc and cgroup trees laid
out as podman and containerd make them, v2 and v1. The real thing: the
unprivileged pod in tests/test_containers.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sampler.shards import container_ids
from sampler.shards.selectors import ProcessTable, Selector
from sampler.sources import cgroup_members, cgroup_view
from sampler.sources.cfs import CfsBandwidthReader
from tests.fakeproc import FakeProc

AGENT = 4242
CONTAINER = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podabc.slice/cri-containerd-1f.scope"
ENGINE = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podxyz.slice/cri-containerd-9a.scope"


@pytest.fixture(autouse=True)
def _forget() -> Iterator[None]:
    cgroup_view.forget_namespace_roots()
    yield
    cgroup_view.forget_namespace_roots()


def _node(tmp_path: Path, v1: bool = False) -> tuple[FakeProc, Path]:
    """A node whose agent sits in CONTAINER, a cgroup namespace of its own
    rooted there (4 deep): kthreadd reads as /../../../.., the agent as /, an
    engine pod beside it as /../../../kubepods-burstable-podxyz.slice/...,
    and a decoy directory at the same depth that does not hold the agent."""
    proc = FakeProc(tmp_path / "proc")
    tree = tmp_path / "host" / "sys" / "fs" / "cgroup"
    top = tree / "cpu,cpuacct" if v1 else tree
    top.mkdir(parents=True)
    if v1:
        (tree / "cpu").symlink_to("cpu,cpuacct")
    else:
        (top / "cgroup.controllers").write_text("cpu memory\n")
    for d, procs in ((CONTAINER, f"{AGENT}\n"), (CONTAINER.replace("1f", "2e"), "77\n"), (ENGINE, "500\n")):
        (top / d.lstrip("/")).mkdir(parents=True)
        (top / d.lstrip("/") / "cgroup.procs").write_text(procs)
    engine = top / ENGINE.lstrip("/")
    if v1:
        (engine / "cpu.cfs_quota_us").write_text("150000\n")
        (engine / "cpu.cfs_period_us").write_text("100000\n")
        (engine / "cpu.stat").write_text("nr_periods 10\nnr_throttled 4\nthrottled_time 2000000\n")
    else:
        (engine / "cpu.max").write_text("150000 100000\n")
        (engine / "cpu.stat").write_text("nr_periods 10\nnr_throttled 4\nthrottled_usec 2000\n")
    line = "4:cpu,cpuacct:" if v1 else "0::"
    proc.add(2, comm="kthreadd")
    (proc.root / "2" / "comm").write_text("kthreadd\n")
    proc.add(AGENT, comm="nodesampler")
    proc.add(500, comm="vllm")
    (proc.root / "2" / "cgroup").write_text(f"{line}/../../../..\n")
    (proc.root / str(AGENT) / "cgroup").write_text(f"{line}/\n")
    (proc.root / "500" / "cgroup").write_text(f"{line}/../../kubepods-burstable-podxyz.slice/cri-containerd-9a.scope\n")
    return proc, tmp_path / "host"


@pytest.mark.parametrize("v1", [False, True], ids=["v2", "v1"])
def test_paths_from_a_private_namespace_are_put_under_its_root(tmp_path: Path, v1: bool) -> None:
    proc, host = _node(tmp_path, v1)
    tree = cgroup_view.host_cgroup_root(host)
    assert tree == host / "sys" / "fs" / "cgroup"
    engine_line = (proc.root / "500" / "cgroup").read_bytes()
    assert cgroup_view.host_paths(engine_line)[0].startswith("/../")  # before: the namespace's view
    assert cgroup_view.learn_namespace_roots(proc.root, tree, pid=AGENT)
    assert cgroup_view.host_paths(engine_line) == [ENGINE]
    assert cgroup_view.host_paths(b"0::/\n" if not v1 else b"4:cpu,cpuacct:/\n") == [CONTAINER]
    # A `cgroup:` selector written with the host's path finds the engine.
    table = ProcessTable.walk(proc.root)
    sel = Selector.parse("cgroup:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podxyz.slice")
    assert table.cgroups(500) == [ENGINE] and table.resolve(sel) == [500]
    # The CFS reader finds the engine's quota in the host's tree.
    cfs = CfsBandwidthReader(proc.root, tree)
    got = cfs.read({"engine": {500}})
    assert got["engine"]["cpu_quota_cores"] == 1.5, got


def test_a_root_that_cannot_be_told_apart_is_not_guessed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    proc, host = _node(tmp_path)
    tree = cgroup_view.host_cgroup_root(host)
    (tree / CONTAINER.replace("1f", "2e").lstrip("/") / "cgroup.procs").write_text(f"{AGENT}\n")  # two hold it
    assert not cgroup_view.learn_namespace_roots(proc.root, tree, pid=AGENT)
    assert "namespace root was not found" in caplog.text
    line = (proc.root / "500" / "cgroup").read_bytes()
    assert cgroup_view.host_paths(line)[0].startswith("/../")  # the namespace's own, never a guess
    # ... and the CFS reader reads nothing outside the tree for it: absent, not another cgroup's figures.
    assert "cpu_quota_cores" not in CfsBandwidthReader(proc.root, tree).read({"engine": {500}}).get("engine", {})


def test_the_hosts_view_needs_nothing(tmp_path: Path) -> None:
    proc, host = _node(tmp_path)
    (proc.root / "2" / "cgroup").write_text("0::/\n")  # the agent shares the host's namespace
    assert cgroup_view.learn_namespace_roots(proc.root, cgroup_view.host_cgroup_root(host), pid=AGENT)
    assert cgroup_view.host_paths(b"0::/a/b\n") == ["/a/b"]
    assert cgroup_view.host_cgroup_root(None) == cgroup_view.CGROUP_ROOT
    assert cgroup_view.host_cgroup_root(tmp_path / "empty") == cgroup_view.CGROUP_ROOT


POD = "/kubepods.slice/kubepods-pod1.slice"
CID = "ab" * 32


def test_the_watched_cgroups_by_the_ids_the_kernel_gives_them(tmp_path: Path) -> None:
    """What the tick follows moves by: each cgroup at or below a path, by its
    directory's inode; nothing on a v1 tree; None past the limit (a tenant
    can make cgroups below its own)."""
    root = tmp_path / "cgroup"
    scope = root / POD.lstrip("/") / f"cri-containerd-{CID}.scope"
    (scope / "inner").mkdir(parents=True)
    (root / "system.slice").mkdir()
    assert cgroup_view.unified_ids_below(POD, root) == {}  # no cgroup.controllers at the root: not v2 alone
    (root / "cgroup.controllers").write_text("cpu memory\n")
    ids = cgroup_view.unified_ids_below(POD, root)
    named = f"{POD}/cri-containerd-{CID}.scope"
    assert ids == {POD: scope.parent.stat().st_ino, named: scope.stat().st_ino,
                   f"{named}/inner": (scope / "inner").stat().st_ino}  # fmt: skip
    assert cgroup_view.unified_ids_below(POD, root, limit=2) is None
    assert cgroup_view.unified_ids_below("/gone", root) == {}
    assert len(cgroup_view.unified_ids_below("/", root) or {}) == 6


def test_which_cgroups_a_selector_names() -> None:
    container = Selector("containers", f"{'cd' * 32},{CID}")
    assert container.names_cgroup(f"{POD}/cri-containerd-{CID}.scope")
    assert container.names_cgroup(f"{POD}/cri-containerd-{CID}.scope/inner")
    assert not container.names_cgroup(POD)
    path = Selector.parse(f"cgroup:{POD}")
    assert path.names_cgroup(POD) and path.names_cgroup(f"{POD}/x")
    assert not path.names_cgroup(POD + "x") and not path.names_cgroup("/kubepods.slice")
    assert Selector.parse("cgroup:/").names_cgroup("/system.slice")
    assert not Selector.parse("pgid:1").names_cgroup("/")
    scope = f"/..{POD}/cri-containerd-{CID}.scope"
    assert container_ids.container_dir(f"{scope}/inner") == scope
    assert container_ids.container_dir(POD) is None


def test_a_cgroups_processes_read_from_the_cgroups_and_the_nodes_containers_by_name(tmp_path: Path) -> None:
    """What a window reads in place of a walk (sampler/sources/cgroup_members.py):
    each process below a path from `cgroup.procs`, and every container's own
    directory, found without descending into a container (a tenant's
    cgroups below its own, one named like another container, are not met)."""
    root = tmp_path / "cgroup"
    scope = root / POD.lstrip("/") / f"cri-containerd-{CID}.scope"
    placed = {scope: "7\n8\n", scope / "inner": "9\n", scope.parent: "", root / "system.slice" / "a.service": "10\n"}
    for d, procs in placed.items():
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.procs").write_text(procs)
    (scope / f"cri-containerd-{'ef' * 32}.scope").mkdir()
    (root / "system.slice" / "link").symlink_to(scope)  # not followed: its processes are the scope's
    (root / "cgroup.controllers").write_text("cpu memory\n")
    assert cgroup_view.unified(root) and not cgroup_view.unified(tmp_path)
    assert cgroup_members.procs_below([POD], root) == {7, 8, 9}
    assert cgroup_members.procs_below(["/system.slice", "/gone"], root) == {10}
    assert cgroup_members.procs_below([POD], root, limit=2) is None
    assert cgroup_members.container_dirs(root) == {CID: f"{POD}/cri-containerd-{CID}.scope"}
    assert cgroup_members.container_dirs(root, limit=3) is None
