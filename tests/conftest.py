"""Fixtures shared by the live and kernel tests."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator

import pytest

from sampler.backend import BackendUnavailable
from tests.workloads import PROC

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
def bpf_groups() -> Iterator[BpfGroupSampler]:  # noqa: F821
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
