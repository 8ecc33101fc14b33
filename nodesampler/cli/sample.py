"""`nodesampler sample`: one window's summary of this machine, as text or JSON."""

from __future__ import annotations

import argparse

import msgspec

import wire
from nodesampler.cli.sampling import kubelet_from, make_sampler, print_bpf


def cmd_sample(args: argparse.Namespace) -> int:
    from sampler.agent.run import default_node
    from sampler.open_sampler import SamplerOptions
    from sampler.sources import host_view
    from sampler.window.summary_text import render

    if args.print_bpf:
        return print_bpf(args.proc_root)
    host_view.join_host_cgroup_namespace(args.proc_root, args.host_root)  # as the agent: the host's cgroup paths
    # One window: it may wait for NVML to start (seconds per GPU) and to answer.
    sampler = make_sampler(SamplerOptions(args.backend, args.hz, args.proc_root, args.group, args.kernel_headers,
                                          gpu_grace=5.0, host_root=args.host_root,
                                          kubelet=kubelet_from(args, default_node()), bpf_stats=args.bpf_stats))
    try:
        if sampler.gpus is not None:
            sampler.gpus.wait_ready(30.0)
        sampler.prime(min(1.0, args.duration))
        summary = sampler.run_window(args.duration)
    finally:
        sampler.close()
    print(msgspec.json.format(wire.encode(summary), indent=2).decode() if args.json else render(summary))
    return 0
