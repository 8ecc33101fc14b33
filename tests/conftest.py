"""Fixtures shared by the live and kernel tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from sampler.backend import BackendUnavailable
from tests.workloads import PROC

if TYPE_CHECKING:
    from sampler.bpf_sched import BpfGroupSampler

# CI sets it: a kernel test that cannot run is a failure, not a skip.
REQUIRE_BPF = os.environ.get("NODESAMPLER_REQUIRE_BPF") == "1"


@pytest.fixture
def group() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@pytest.fixture
def bpf_groups() -> Iterator[BpfGroupSampler]:
    """The kernel backend, loaded into this kernel; closed after the test."""
    from sampler import bpf_sched

    try:
        sampler = bpf_sched.load(PROC, 10)
    except BackendUnavailable as e:
        if REQUIRE_BPF:
            pytest.fail(f"NODESAMPLER_REQUIRE_BPF=1 and the kernel backend cannot load: {e}")
        pytest.skip(f"kernel backend unavailable: {e}")
    yield sampler
    sampler.close()


class AccuracyLog:
    """Each accuracy comparison a kernel test makes, appended as a JSON line to
    the file NODESAMPLER_ACCURACY_LOG names (the VM harness prints them in its
    table); nothing when it is unset. Recorded before the assertion, so a
    failing comparison is in the log too."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def record(self, check: str, measured: float, truth: float, bound: float) -> None:
        if self.path is None:
            return
        error = abs(measured - truth) / truth if truth else float("inf")
        line = {"check": check, "measured": measured, "truth": truth, "error": round(error, 5), "bound": bound}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")


@pytest.fixture
def accuracy() -> AccuracyLog:
    path = os.environ.get("NODESAMPLER_ACCURACY_LOG")
    return AccuracyLog(Path(path) if path else None)
