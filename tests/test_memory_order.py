"""The choice of memory order for the kernel's shared memory
(sampler/kernel/memory_order.py); the kernel tier checks the programs'
atomics and the publication itself."""

from __future__ import annotations

import ctypes

import pytest

from sampler.backend_unavailable import BackendUnavailable
from sampler.kernel import memory_order


@pytest.mark.parametrize(("machine", "ordered"), [("x86_64", True), ("aarch64", False), ("ppc64le", False),
                                                  ("riscv64", False)])  # fmt: skip
def test_only_x86_is_taken_to_keep_the_source_s_order(machine: str, ordered: bool) -> None:
    assert memory_order.in_order(machine) is ordered
    fence = memory_order.reader_fence(machine)
    assert (fence is memory_order._no_fence) is ordered
    fence()  # libatomic's, where it is needed: it runs here too


def test_a_cpu_that_reorders_without_libatomic_refuses_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str, *args: object, **kwargs: object) -> ctypes.CDLL:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    with pytest.raises(BackendUnavailable, match="install libatomic1"):
        memory_order.reader_fence("aarch64")
    assert memory_order.reader_fence("x86_64")() is None  # x86 needs none


@pytest.mark.parametrize(("release", "machine", "flags"), [
    ("6.12.48+deb13-arm64", "aarch64", ["-DFETCH_ATOMICS=1"]),
    ("5.12.0", "aarch64", ["-DFETCH_ATOMICS=1"]),
    ("6.1.0-18-amd64", "x86_64", ["-DFETCH_ATOMICS=1"]),
    ("5.10.0-30-amd64", "x86_64", []),
])  # fmt: skip
def test_the_programs_publish_with_fetching_atomics_from_5_12(release: str, machine: str, flags: list[str]) -> None:
    assert memory_order.program_flags(release, machine) == flags


def test_an_older_kernel_on_a_cpu_that_reorders_refuses_the_backend() -> None:
    with pytest.raises(BackendUnavailable, match=r"older than 5\.12.*aarch64"):
        memory_order.program_flags("5.10.0-30-arm64", "aarch64")
