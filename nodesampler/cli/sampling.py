"""What `sample`, `up` and `agent` share: the sampler opened from the flags, or the command's end with why."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from nodesampler.cli.parser import EXIT_BACKEND, EXIT_USAGE, SERVICE_ACCOUNT_TOKEN, fail

if TYPE_CHECKING:  # the sampler's modules load with the command that samples, not with the CLI
    from sampler.open_sampler import SamplerOptions
    from sampler.shards.kubelet import KubeletPods
    from sampler.window.sampler import WindowSampler

log = logging.getLogger("nodesampler")


def kubelet_from(args: argparse.Namespace, node: str) -> KubeletPods:
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


def make_sampler(options: SamplerOptions) -> WindowSampler:
    """The sampler (sampler/open_sampler.py), or the command's end with the reason."""
    from sampler.backend_unavailable import BackendUnavailable
    from sampler.open_sampler import OptionError, open_sampler

    try:
        return open_sampler(options)
    except OptionError as e:
        fail(EXIT_USAGE, str(e))
    except BackendUnavailable as e:
        fail(EXIT_BACKEND, f"backend {options.backend} unavailable: {e}")


def print_bpf(proc: Path) -> int:
    """What the kernel backend compiles: its flags, from this kernel's BTF, and its source."""
    from sampler.backend_unavailable import BackendUnavailable
    from sampler.kernel import btf, build, memory_order
    from sampler.sources.cpu_lists import possible_cpus

    try:
        flags = " ".join(build.compile_flags(btf.task_offsets(), build.read_pid_max(proc), possible_cpus())
                         + memory_order.program_flags())  # fmt: skip
    except (btf.BtfError, BackendUnavailable, OSError, ValueError) as e:
        flags = f"(unknown: {e})"
    print(f"// {build.SOURCE}\n// cflags: {flags}\n")
    print(build.SOURCE.read_text(), end="")
    return 0


def stop_on_sigterm() -> None:
    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
