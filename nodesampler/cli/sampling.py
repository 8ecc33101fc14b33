"""What `sample`, `up` and `agent` share: the sampler built from the flags, and closed."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from nodesampler.cli.parser import EXIT_BACKEND, EXIT_USAGE, SERVICE_ACCOUNT_TOKEN, fail

log = logging.getLogger("nodesampler")


def kubelet_from(args: argparse.Namespace, node: str):  # type: ignore[no-untyped-def]
    from sampler.shards.kubelet import KubeletPods

    url = args.kubelet_url or f"https://{os.environ.get('NODE_IP') or '127.0.0.1'}:10250"
    token = args.kubelet_token_file
    if token is None and SERVICE_ACCOUNT_TOKEN.is_file():
        token = SERVICE_ACCOUNT_TOKEN
    for flag, path in (("--kubelet-token-file", args.kubelet_token_file), ("--kubelet-ca-file", args.kubelet_ca_file)):
        if path is not None and not path.is_file():
            fail(EXIT_USAGE, f"{flag} {path}: not a file")
    if args.kubelet_insecure_skip_tls_verify and args.kubelet_ca_file is not None:
        fail(EXIT_USAGE, "--kubelet-ca-file and --kubelet-insecure-skip-tls-verify: give one")
    try:
        return KubeletPods(url, token, args.kubelet_ca_file, node=node,
                           verify=not args.kubelet_insecure_skip_tls_verify)  # fmt: skip
    except (ValueError, OSError) as e:  # a bad URL; a CA file that does not load
        fail(EXIT_USAGE, f"--kubelet-url/--kubelet-ca-file: {e}")


def make_sampler(  # type: ignore[no-untyped-def]
    backend: str,
    groups: list[tuple[str, str]],
    hz: float,
    proc: Path,
    kernel_headers: Path | str | None = None,
    gpu_grace: float = 0.0,
    sleep: Callable[[float], None] | None = None,
    node: str | None = None,
    host_root: Path | None = None,
    kubelet=None,  # noqa: ANN001
    bpf_stats: bool = False,
):
    from sampler.backend import open_backend
    from sampler.backend_unavailable import BackendUnavailable
    from sampler.gpu.nvml import GpuReader
    from sampler.shards.selectors import Selector, ShardSpec
    from sampler.window.sampler import WindowSampler

    if not proc.is_dir():
        fail(EXIT_USAGE, f"--proc-root {proc}: not a directory")
    if host_root is not None and not host_root.is_dir():
        fail(EXIT_USAGE, f"--host-root {host_root}: not a directory")
    names = [n for n, _ in groups]
    if len(set(names)) != len(names):
        fail(EXIT_USAGE, "--group: each NAME may be given once")
    try:
        choice, shard_sampler = open_backend(backend, proc, kernel_headers, bpf_stats=bpf_stats)
    except BackendUnavailable as e:
        fail(EXIT_BACKEND, f"backend {backend} unavailable: {e}")
    finest = shard_sampler.finest_hz
    if finest is not None and hz > finest:
        why = (f"the {choice.name} backend's counters move in ticks of up to 10 ms: above {finest:g} samples "
               "a second, a tick early or late is more than a tenth of a busy thread's time")  # fmt: skip
        if backend == choice.name:
            shard_sampler.close()
            fail(EXIT_USAGE, f"--hz {hz:g}: {why}")
        log.warning("--hz %g capped at %g: %s", hz, finest, why)
        hz = finest
    specs = [ShardSpec(name, Selector.parse(sel)) for name, sel in groups] or None
    return WindowSampler(proc, choice, shard_sampler, specs, hz=hz, node=node, gpus=GpuReader(),
                         gpu_grace=gpu_grace, sleep=sleep or time.sleep, host_root=host_root,
                         kubelet=kubelet)  # fmt: skip


def close_sampler(sampler) -> None:  # type: ignore[no-untyped-def]
    sampler.shard_sampler.close()
    if sampler.kubelet is not None:
        sampler.kubelet.close()
    sampler.runqueue.close()
    if sampler.gpus is not None:
        sampler.gpus.close()


def print_bpf(proc: Path) -> int:
    """What the kernel backend compiles: its flags, from this kernel's BTF, and its source."""
    from sampler.backend_unavailable import BackendUnavailable
    from sampler.kernel import btf, build
    from sampler.sources.cpu_lists import possible_cpus

    try:
        flags = " ".join(build.compile_flags(btf.task_offsets(), build.read_pid_max(proc), possible_cpus()))
    except (btf.BtfError, BackendUnavailable, OSError, ValueError) as e:
        flags = f"(unknown: {e})"
    print(f"// {build.SOURCE}\n// cflags: {flags}\n")
    print(build.SOURCE.read_text(), end="")
    return 0


def stop_on_sigterm() -> None:
    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
