"""`nodesampler agent`: the node agent, heartbeating to the control plane."""

from __future__ import annotations

import argparse
import logging
import sys

from nodesampler.cli.parser import EXIT_USAGE, fail
from nodesampler.cli.sampling import kubelet_from, make_sampler


def cmd_agent(args: argparse.Namespace) -> int:
    import asyncio
    import ssl
    import threading

    import wire
    from sampler.agent.config import ConfigError, ConfigFile, TokenFile
    from sampler.agent.run import Agent, AgentFailed, default_node
    from sampler.open_sampler import SamplerOptions
    from sampler.sources import host_view
    from sampler.window.hindsight import HindsightRing
    from wire import discovery

    logging.getLogger().setLevel(logging.INFO)
    # First, while this is the only thread: later threads inherit the host's cgroup paths.
    host_view.join_host_cgroup_namespace(args.proc_root, args.host_root)

    node = args.node or default_node()
    try:
        wire.node_id(node)
    except wire.WireError:
        fail(EXIT_USAGE, f"--node {node!r}: letters, digits, '.', '-' or '_' only")
    for url in args.control_plane:
        if (why := discovery.check(url)) is not None:
            fail(EXIT_USAGE, f"--control-plane {url!r}: {why}")
    if len(set(args.control_plane)) != len(args.control_plane):
        fail(EXIT_USAGE, "--control-plane: a replica given twice")
    try:
        token = TokenFile(args.token_file)
    except (OSError, ValueError) as e:
        fail(EXIT_USAGE, f"--token-file: {e}")
    context = None
    if args.ca_file is not None:
        if not all(discovery.scheme(url) == "https" for url in args.control_plane):
            fail(EXIT_USAGE, "--ca-file is for an https:// control plane (every --control-plane)")
        try:
            context = ssl.create_default_context(cafile=str(args.ca_file))
        except (OSError, ssl.SSLError) as e:
            fail(EXIT_USAGE, f"--ca-file {args.ca_file}: {e}")
    config = None
    if args.config is not None:
        try:
            config = ConfigFile(args.config)
        except (OSError, ConfigError) as e:
            fail(EXIT_USAGE, f"--config: {e}")
    stopping = threading.Event()

    def sleep(seconds: float) -> None:
        stopping.wait(seconds)

    sampler = make_sampler(SamplerOptions(args.backend, args.hz, args.proc_root, [], args.kernel_headers,
                                          sleep=sleep, node=node, host_root=args.host_root,
                                          kubelet=kubelet_from(args, node), bpf_stats=args.bpf_stats))
    if config is not None:
        sampler.specs = config.specs
    logging.getLogger().setLevel(logging.INFO)
    if args.hindsight > 0:
        sampler.hindsight = HindsightRing(args.hindsight, args.hindsight_mib, args.hz)
        logging.getLogger(__name__).info("%s", sampler.hindsight.describe(args.hindsight))
    try:
        agent = Agent(sampler, args.control_plane, token, node, args.interval, stopping, config, context,
                      host_view.host_name(args.proc_root, args.host_root), args.alive_file)  # fmt: skip
        asyncio.run(agent.run())
    except AgentFailed as e:
        # The traceback is in the log already: one line more, and the supervisor restarts us.
        print(f"nodesampler: error: {e}", file=sys.stderr)
        return 1
    finally:
        sampler.close()
    return 0
