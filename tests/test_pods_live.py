"""Pods on this machine, as the kubelet lays them out: cgroups named as a
container runtime names them (cgroupfs driver shapes on this host's cgroup
v1, systemd driver shapes on the guests' v2), busy processes moved into two
pods of one Deployment and a third of another, and a kubelet over TLS that
names them. The agent's window reports exactly the selected pods, with
their labels, each pod's cores against the kernel's account; a restart (a
new container id, new processes) keeps the shard and moves the counting.

Root, on both backends (NODESAMPLER_REQUIRE_BPF=1 fails instead of skipping).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from sampler.backend import BackendChoice, ShardSampler
from sampler.shards.kubelet import KubeletPods
from sampler.shards.proc_shards import ProcShardSampler
from sampler.shards.selectors import Selector, ShardSpec
from sampler.window.sampler import WindowSampler
from tests.conftest import CGROUP, AccuracyLog, unavailable
from tests.fakekubelet import FakeKubelet, pod_doc
from tests.heartbeats import cores_of
from tests.workloads import PROC, busy_threads, process_cpu_seconds, stamped, start_group, then_after_each_reading
from wire.schema import Shard

pytestmark = pytest.mark.kernel

WINDOW_S = 2.0
LABELS = {"app": "vllm", "model": "llama-3-8b"}


class PodCgroups:
    """Container cgroups where a kubelet would make them, under a root of the test's own."""

    def __init__(self) -> None:
        self.v2 = (CGROUP / "cgroup.controllers").exists()
        self.hierarchy = CGROUP if self.v2 else CGROUP / "cpu"
        self.top = self.hierarchy / (f"nodesampler-test-{os.getpid()}" + (".slice" if self.v2 else ""))
        self.made: list[Path] = []

    def container(self, pod_uid: str) -> tuple[str, Path]:
        """A new container of the pod: its id and its cgroup, with the runtime's name for it."""
        cid = secrets.token_hex(32)
        if self.v2:  # containerd under the systemd driver
            uid = pod_uid.replace("-", "_")
            path = (self.top / "kubepods.slice" / "kubepods-burstable.slice" / f"kubepods-burstable-pod{uid}.slice"
                    / f"cri-containerd-{cid}.scope")  # fmt: skip
        else:  # containerd under the cgroupfs driver
            path = self.top / "kubepods" / "burstable" / f"pod{pod_uid}" / cid
        path.mkdir(parents=True)
        self.made.append(path)
        return cid, path

    def remove(self) -> None:
        for leaf in self.made:
            for pid in (leaf / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    (self.hierarchy / "cgroup.procs").write_text(pid)
        dirs = sorted({p for leaf in self.made for p in [leaf, *leaf.parents] if self.top in [p, *p.parents]},
                      key=lambda p: -len(p.parts))  # fmt: skip
        for d in dirs:
            deadline = time.monotonic() + 10
            while d.exists():
                try:
                    d.rmdir()
                except OSError:
                    assert time.monotonic() < deadline, f"{d} not removable"
                    time.sleep(0.05)


@pytest.fixture
def pod_cgroups() -> Iterator[PodCgroups]:
    if os.geteuid() != 0:
        unavailable("making cgroups needs root")
    made = PodCgroups()
    if not made.hierarchy.is_dir():
        unavailable(f"no cgroup hierarchy at {made.hierarchy}")
    yield made
    made.remove()


@pytest.fixture(params=["bpf", "proc"])
def backend(request: pytest.FixtureRequest) -> Iterator[tuple[str, ShardSampler]]:
    if request.param == "proc":
        yield "proc", ProcShardSampler(PROC)
        return
    yield "bpf", request.getfixturevalue("bpf_groups")


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[FakeKubelet]:
    k = FakeKubelet(tmp_path)
    yield k
    k.stop()


def run_pod(cgroups: PodCgroups, uid: str, duty: float, started: list[subprocess.Popen[str]]) -> tuple[str, int]:
    """A one-process container busy `duty` of the time: its id and pid."""
    cid, path = cgroups.container(uid)
    p = start_group(busy_threads(1, duty=duty), tag=f"pod-{uid}")
    started.append(p)
    (path / "cgroup.procs").write_text(str(p.pid))
    return cid, p.pid


class EdgeTruth:
    """The kernel's account of the pods' processes (`pids`), read right after
    each of the sampler's group readings, so that a window's truth covers the
    interval its samples do, as the kernel tests' does. Read around
    `run_window` instead, it also counted the window's end (the summary's
    work, tens of milliseconds in an emulated guest): a pod busy a quarter of
    the time was 5.7% off in the 6.12 guest once."""

    def __init__(self, groups: ShardSampler, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pids: dict[str, int] = {}
        self.last: dict[str, tuple[float, float]] | None = None  # each pod (when, seconds), stamped as read
        def truth() -> None:
            self.last = {k: stamped(partial(process_cpu_seconds, p)) for k, p in self.pids.items()}

        sample, take = then_after_each_reading(groups, truth)
        monkeypatch.setattr(groups, "sample", sample)
        monkeypatch.setattr(groups, "take_kernel_samples", take)

    def window(self, sampler: WindowSampler) -> tuple[dict[str, Shard], dict[str, float]]:
        """One window's shards by id, and each pod's cores over the same interval."""
        assert self.last is not None, "the sampler has not read the groups yet"
        before = self.last
        summary = sampler.run_window(WINDOW_S)
        after = self.last
        cores = {k: (after[k][1] - before[k][1]) / (after[k][0] - before[k][0]) for k in self.pids}
        return {s.id: s for s in summary.shards}, cores


def test_pods_of_a_deployment_on_both_backends(backend: tuple[str, ShardSampler], pod_cgroups: PodCgroups,
                                               kubelet: FakeKubelet, accuracy: AccuracyLog,
                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    name, groups = backend
    truth_of = EdgeTruth(groups, monkeypatch)
    started: list[subprocess.Popen[str]] = []
    uids = {pod: str(uuid.uuid4()) for pod in ("engine-0", "engine-1", "router-0")}
    duties = {"engine-0": 0.5, "engine-1": 0.25, "router-0": 0.25}
    try:
        ids, pids = {}, {}
        for pod, duty in duties.items():
            ids[pod], pids[pod] = run_pod(pod_cgroups, uids[pod], duty, started)
        labels = {"engine-0": {**LABELS, "replica": "r0"}, "engine-1": {**LABELS, "replica": "r1"},
                  "router-0": {"app": "router"}}  # fmt: skip
        kubelet.pods = [pod_doc("llm", pod, {"vllm": ids[pod]}, labels[pod], uid=uids[pod]) for pod in duties]
        pods = KubeletPods(kubelet.url, kubelet.token_file, kubelet.ca_file, poll_s=3600, refresh_s=0)
        spec = ShardSpec("k8s:0", Selector.parse("k8s:llm/app=vllm"), model_label="model",
                           replica_label="replica")  # fmt: skip
        sampler = WindowSampler(PROC, BackendChoice(name, None), groups, [spec], hz=20, node="n1", kubelet=pods)
        try:
            truth_of.pids = {p: pids[p] for p in ("engine-0", "engine-1")}
            sampler.prime(0)
            shards, truth = truth_of.window(sampler)
            assert sorted(shards) == ["llm/engine-0", "llm/engine-1"]  # the router is another Deployment's
            for pod in ("engine-0", "engine-1"):
                s = shards[f"llm/{pod}"]
                assert (s.namespace, s.pod, s.model, s.replica) == ("llm", pod, "llama-3-8b",
                                                                    labels[pod]["replica"])  # fmt: skip
                assert s.container is None and s.pgids == (pids[pod],)
                accuracy.record(f"pod {pod} mean, {name}", cores_of(s).mean, truth[pod], 0.05)
                assert cores_of(s).mean == pytest.approx(truth[pod], rel=0.05, abs=0.01), (pod, s, truth)

            # engine-0 restarts: a new container (new id, new process, busier), the old one gone.
            os.killpg(pids["engine-0"], signal.SIGKILL)
            started[0].wait()
            ids["engine-0"], pids["engine-0"] = run_pod(pod_cgroups, uids["engine-0"], 1.0, started)
            kubelet.pods[0] = pod_doc("llm", "engine-0", {"vllm": ids["engine-0"]}, labels["engine-0"],
                                      uid=uids["engine-0"])  # fmt: skip
            truth_of.pids = {"engine-0": pids["engine-0"]}
            polls = pods.wait_for_poll(0, 0)
            sampler.run_window(0.2)  # its walk meets the new container and asks the kubelet
            pods.wait_for_poll(polls, 10)
            sampler.run_window(0.2)  # the new container's first reading
            shards, truth = truth_of.window(sampler)
            s = shards["llm/engine-0"]
            assert s.pgids == (pids["engine-0"],)
            # On cgroup v2 the windows after the first read the pods' cgroups, not /proc: the new
            # container was met in the cgroup tree. On v1 each window walks.
            assert sampler.view.walks == 1 if pod_cgroups.v2 else sampler.view.walks >= 4
            accuracy.record(f"restarted pod mean, {name}", cores_of(s).mean, truth["engine-0"], 0.05)
            assert cores_of(s).mean == pytest.approx(truth["engine-0"], rel=0.05, abs=0.01), (s, truth)
        finally:
            pods.close()
    finally:
        for p in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
