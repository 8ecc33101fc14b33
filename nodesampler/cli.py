"""The `nodesampler` command.

Every misuse is one line on stderr and exit code 2; a backend that was asked
for and cannot run is exit code 3 with the reason.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from nodesampler import __version__

EXIT_USAGE = 2
EXIT_BACKEND = 3
ADMIN_SOCKET = "/run/nodesampler/admin.sock"  # where the shipped Deployment puts the control plane's

log = logging.getLogger("nodesampler")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block: scripts and operators read the reason.
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _positive(limit: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(v) or v <= 0 or v > limit:
            raise argparse.ArgumentTypeError(f"must be above 0 and at most {limit:g}: {text!r}")
        return v

    return parse


def _within(lo: float, hi: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(v) or not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be from {lo:g} to {hi:g}: {text!r}")
        return v

    return parse


def _count(hi: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) > hi:
            raise argparse.ArgumentTypeError(f"must be a whole number from 0 to {hi}: {text!r}")
        return int(text)

    return parse


def _kernel_headers(text: str) -> Path | str | None:
    if text == "bundled":
        return None
    if text == "installed":
        return text
    return Path(text)


def _kernel_headers_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernel-headers", type=_kernel_headers, default=None, metavar="bundled|installed|DIR",
                   help="what the kernel backend compiles against: the headers it ships (default), the "
                        "distribution's in /lib/modules/$(uname -r), or a kernel source tree")  # fmt: skip


def _group(text: str) -> tuple[str, str]:
    from sampler.shards.selectors import Selector

    name, sep, selector = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=SELECTOR: {text!r}")
    if not name.isprintable() or len(name) > 128:
        raise argparse.ArgumentTypeError(f"group name must be printable text of at most 128 characters: {name!r}")
    try:
        Selector.parse(selector)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name, selector


SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


def _kubelet_flags(p: argparse.ArgumentParser) -> None:
    """Where `k8s:` selectors learn this node's pods; unused without one."""
    p.add_argument("--kubelet-url", default=None, metavar="URL",
                   help="this node's kubelet (default: https://$NODE_IP:10250, else https://127.0.0.1:10250)")
    p.add_argument("--kubelet-token-file", type=Path, default=None, metavar="PATH",
                   help=f"bearer token for the kubelet, re-read at each poll (default: {SERVICE_ACCOUNT_TOKEN} "
                        "where it exists)")  # fmt: skip
    p.add_argument("--kubelet-ca-file", type=Path, default=None, metavar="PATH",
                   help="CA bundle (PEM) the kubelet's certificate must chain to: the cluster's CA where kubelets "
                        "serve certificates it signs (serverTLSBootstrap) (default: the system's trust store)")
    p.add_argument("--kubelet-insecure-skip-tls-verify", action="store_true",
                   help="do not verify the kubelet's certificate (kubelets with self-signed certificates): its "
                        "token then goes to whatever answers at --kubelet-url; said in the log at start")  # fmt: skip


def _bpf_stats_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bpf-stats", action="store_true",
                   help="report the kernel programs' runs and run time (turns on the kernel's BPF statistics, "
                        "which time every BPF program on the host, while the sampler runs)")  # fmt: skip


def _kubelet(args: argparse.Namespace, node: str):  # type: ignore[no-untyped-def]
    from sampler.shards.kubelet import KubeletPods

    url = args.kubelet_url or f"https://{os.environ.get('NODE_IP') or '127.0.0.1'}:10250"
    token = args.kubelet_token_file
    if token is None and SERVICE_ACCOUNT_TOKEN.is_file():
        token = SERVICE_ACCOUNT_TOKEN
    for flag, path in (("--kubelet-token-file", args.kubelet_token_file), ("--kubelet-ca-file", args.kubelet_ca_file)):
        if path is not None and not path.is_file():
            _fail(EXIT_USAGE, f"{flag} {path}: not a file")
    if args.kubelet_insecure_skip_tls_verify and args.kubelet_ca_file is not None:
        _fail(EXIT_USAGE, "--kubelet-ca-file and --kubelet-insecure-skip-tls-verify: give one")
    try:
        return KubeletPods(url, token, args.kubelet_ca_file, node=node,
                           verify=not args.kubelet_insecure_skip_tls_verify)  # fmt: skip
    except (ValueError, OSError) as e:  # a bad URL; a CA file that does not load
        _fail(EXIT_USAGE, f"--kubelet-url/--kubelet-ca-file: {e}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="nodesampler", description="How busy this machine is, and which engine makes it so.")
    p.add_argument("--version", action="version", version=f"nodesampler {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("sample", help="sample one window of this machine and print its summary")
    s.add_argument("--backend", choices=("auto", "bpf", "proc"), default="auto")
    s.add_argument("--group", action="append", type=_group, default=[], metavar="NAME=SELECTOR",
                   help="an engine to report: pgid:N, pid:N, cmdline:RE, comm:NAME, cgroup:PATH or k8s:NS/LABELS")
    s.add_argument("--hz", type=_positive(1000), default=10.0, help="samples a second (default 10)")
    s.add_argument("--duration", type=_positive(3600), default=5.0, help="the window, seconds (default 5)")
    s.add_argument("--json", action="store_true", help="print the heartbeat summary as JSON")
    s.add_argument("--proc-root", type=Path, default=Path("/proc"), help="the procfs to read (default /proc)")
    s.add_argument("--host-root", type=Path, default=None, metavar="DIR",
                   help="the host's / mounted in this container: disks are measured through it")
    _kernel_headers_flag(s)
    s.add_argument("--print-bpf", action="store_true", help=argparse.SUPPRESS)
    _kubelet_flags(s)
    _bpf_stats_flag(s)

    a = sub.add_parser("agent", help="sample this node and send a heartbeat per window to the control plane")
    a.add_argument("--control-plane", required=True, metavar="URL", help="the control plane's agent listener")
    a.add_argument("--token-file", required=True, type=Path, metavar="PATH",
                   help="this node's token (HMAC or projected service-account token), re-read when it changes")
    a.add_argument("--ca-file", type=Path, default=None, metavar="PATH",
                   help="CA bundle (PEM) an https control plane's certificate must chain to (default: the system's)")
    a.add_argument("--node", default=None, help="this node's name (default: $NODE_NAME, else the host name)")
    a.add_argument("--config", type=Path, default=None, metavar="PATH",
                   help="TOML with the shards to watch, re-read when it changes (default: the busiest groups)")
    a.add_argument("--hz", type=_positive(1000), default=10.0, help="samples a second (default 10)")
    a.add_argument("--interval", type=_positive(3600), default=5.0, help="seconds per heartbeat (default 5)")
    a.add_argument("--backend", choices=("auto", "bpf", "proc"), default="auto")
    a.add_argument("--proc-root", type=Path, default=Path("/proc"), help="the procfs to read (default /proc)")
    a.add_argument("--host-root", type=Path, default=None, metavar="DIR",
                   help="the host's / mounted in this container: disks are measured through it")
    a.add_argument("--alive-file", type=Path, default=None, metavar="PATH",
                   help="touched each time a window reaches the sender, for a liveness probe to read "
                        "(default: none)")  # fmt: skip
    _kernel_headers_flag(a)
    _kubelet_flags(a)
    _bpf_stats_flag(a)

    c = sub.add_parser("controlplane", help="the fleet's registry, agent API, pages and /metrics")
    c.add_argument("--listen", required=True, metavar="ADDR", help="HOST:PORT for agents")
    c.add_argument("--pages-listen", required=True, metavar="ADDR", help="HOST:PORT for pages and /health")
    c.add_argument("--secret-file", type=Path, metavar="PATH",
                   help="the cluster secret, for HMAC node tokens (needed unless --k8s-jwks is given)")
    c.add_argument("--tls-cert", type=Path, metavar="PATH", help="TLS certificate (PEM) of the agent listener")
    c.add_argument("--tls-key", type=Path, metavar="PATH", help="its private key (PEM); both re-read when they change")
    c.add_argument("--web-config-file", type=Path, default=None, metavar="PATH",
                   help="Prometheus' web configuration file: TLS for both listeners, basic_auth_users for the pages")
    c.add_argument("--pages-host", action="append", default=[], metavar="NAME",
                   help="a host name the pages listener serves (repeatable); with any, a request for another "
                        "name is refused (an IP address is always served)")
    c.add_argument("--admin-socket", type=Path, default=None, metavar="PATH",
                   help="a Unix socket (mode 0600) for `nodesampler forget` on this machine")
    c.add_argument("--k8s-jwks", metavar="FILE_OR_URL",
                   help="accept Kubernetes projected service-account tokens, verified with these issuer keys")
    c.add_argument("--k8s-issuer", metavar="ISSUER", help="the service-account issuer (the tokens' iss)")
    c.add_argument("--k8s-audience", default="nodesampler", metavar="AUD", help="the tokens' audience")
    c.add_argument("--k8s-service-account", default="nodesampler/nodesampler-agent", metavar="NAMESPACE/NAME",
                   help="the agents' service account (default nodesampler/nodesampler-agent)")
    c.add_argument("--stale-after", type=_positive(86400), default=60.0,
                   help="seconds after its last heartbeat that a node is stale (default 60)")
    c.add_argument("--state-file", type=Path, default=None, metavar="PATH",
                   help="keep the known nodes in this file across restarts (written atomically every 30 s)")
    c.add_argument("--forget-after", type=_positive(365 * 86400), default=7 * 86400.0, metavar="S",
                   help="seconds a silent node stays known (llmgw_node_up 0) before it is forgotten "
                        "(default 604800: a week); DELETE /api/nodes/NODE forgets one at once")
    c.add_argument("--max-shards-per-node", type=_count(256), default=64, metavar="N",
                   help="engines of one node exported, charted and shown, the busiest kept (default 64)")
    c.add_argument("--max-live-nodes", type=_count(1000), default=10, metavar="N",
                   help="nodes watched live (every sample) at once; 0: no live view (default 10)")
    c.add_argument("--max-heartbeats-per-second", type=_count(1000), default=2, metavar="N",
                   help="a node's heartbeats taken a second, sustained (a burst of five seconds' worth, at least 10; "
                        "429 beyond); 0: no limit (default 2)")  # fmt: skip
    c.add_argument("--live-linger", type=_positive(3600), default=60.0, metavar="S",
                   help="seconds a node keeps sending every sample after its last live viewer left (default 60)")
    c.add_argument("--prometheus", default=None, metavar="URL",
                   help="draw the pages' charts from this Prometheus (default: the embedded history)")
    # Connections held to account (controlplane/listen/connection_limits.py).
    c.add_argument("--request-deadline", type=_positive(3600), default=10.0, metavar="S",
                   help="seconds a request has, from its first byte, to arrive whole and be answered (default 10)")
    c.add_argument("--idle-timeout", type=_positive(86400), default=60.0, metavar="S",
                   help="seconds a connection may stay open with no request under way (default 60)")
    c.add_argument("--max-connections-per-peer", type=_count(1_000_000), default=256, metavar="N",
                   help="connections one peer address may hold on each listener; 0: no cap (default 256)")
    # The verdict's thresholds (controlplane/state/starvation.py, docs/metrics.md).
    c.add_argument("--starved-throttled-ratio", type=_within(0, 1), default=0.25, metavar="R",
                   help="CPU-starved above this share of CFS periods throttled in a window (default 0.25)")
    c.add_argument("--starved-wait-ratio", type=_within(0, 1e6), default=0.5, metavar="R",
                   help="CPU-starved above this many seconds waiting for a CPU per second on one (default 0.5)")
    c.add_argument("--starved-min-wait", type=_within(0, 1e6), default=0.05, metavar="S",
                   help="... and at least this many seconds waiting per second of the window (default 0.05)")
    c.add_argument("--host-bound-gpu-utilization", type=_within(0, 1), default=0.5, metavar="R",
                   help="host-bound: CPU-starved while its GPUs were busy under this share of the time (default 0.5)")

    f = sub.add_parser("forget", help="forget a node gone for good, through the control plane's admin socket")
    f.add_argument("node", metavar="NODE")
    f.add_argument("--admin-socket", type=Path, default=Path(ADMIN_SOCKET), metavar="PATH",
                   help=f"the control plane's --admin-socket (default {ADMIN_SOCKET})")

    t = sub.add_parser("token", help="print a node's token, derived from the cluster secret")
    t.add_argument("node", metavar="NODE")
    t.add_argument("--secret-file", required=True, type=Path, metavar="PATH", help="the cluster secret")

    u = sub.add_parser("up", help="the control plane and an agent on this machine, with the pages")
    u.add_argument("--listen", default="127.0.0.1:8080", metavar="ADDR",
                   help="HOST:PORT of the pages (default 127.0.0.1:8080); agents talk to PORT+1")
    u.add_argument("--hz", type=_positive(1000), default=10.0, help="samples a second (default 10)")
    u.add_argument("--interval", type=_positive(3600), default=5.0, help="seconds per heartbeat (default 5)")
    return p


def _fail(code: int, message: str) -> NoReturn:
    print(f"nodesampler: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _make_sampler(  # type: ignore[no-untyped-def]
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
        _fail(EXIT_USAGE, f"--proc-root {proc}: not a directory")
    if host_root is not None and not host_root.is_dir():
        _fail(EXIT_USAGE, f"--host-root {host_root}: not a directory")
    names = [n for n, _ in groups]
    if len(set(names)) != len(names):
        _fail(EXIT_USAGE, "--group: each NAME may be given once")
    try:
        choice, shard_sampler = open_backend(backend, proc, kernel_headers, bpf_stats=bpf_stats)
    except BackendUnavailable as e:
        _fail(EXIT_BACKEND, f"backend {backend} unavailable: {e}")
    finest = shard_sampler.finest_hz
    if finest is not None and hz > finest:
        why = (f"the {choice.name} backend's counters move in ticks of up to 10 ms: above {finest:g} samples "
               "a second, a tick early or late is more than a tenth of a busy thread's time")  # fmt: skip
        if backend == choice.name:
            shard_sampler.close()
            _fail(EXIT_USAGE, f"--hz {hz:g}: {why}")
        log.warning("--hz %g capped at %g: %s", hz, finest, why)
        hz = finest
    specs = [ShardSpec(name, Selector.parse(sel)) for name, sel in groups] or None
    return WindowSampler(proc, choice, shard_sampler, specs, hz=hz, node=node, gpus=GpuReader(),
                         gpu_grace=gpu_grace, sleep=sleep or time.sleep, host_root=host_root,
                         kubelet=kubelet)  # fmt: skip


def _close(sampler) -> None:  # type: ignore[no-untyped-def]
    sampler.shard_sampler.close()
    if sampler.kubelet is not None:
        sampler.kubelet.close()
    sampler.runqueue.close()
    if sampler.gpus is not None:
        sampler.gpus.close()


def _print_bpf(proc: Path) -> int:
    """What the kernel backend compiles: its flags, from this kernel's BTF, and its source."""
    from sampler.backend_unavailable import BackendUnavailable
    from sampler.kernel import btf, sched

    try:
        flags = " ".join(sched.compile_flags(btf.task_offsets(), sched.read_pid_max(proc), sched.possible_cpus()))
    except (btf.BtfError, BackendUnavailable, OSError, ValueError) as e:
        flags = f"(unknown: {e})"
    print(f"// {sched.SOURCE}\n// cflags: {flags}\n")
    print(sched.SOURCE.read_text(), end="")
    return 0


def _stop_on_sigterm() -> None:
    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def cmd_sample(args: argparse.Namespace) -> int:
    from sampler.agent import default_node
    from sampler.sources import host_view
    from sampler.window.summary_text import render

    if args.print_bpf:
        return _print_bpf(args.proc_root)
    host_view.join_host_cgroup_namespace(args.proc_root, args.host_root)  # as the agent: the host's cgroup paths
    # One window: it may wait for NVML to start (seconds per GPU) and to answer.
    sampler = _make_sampler(args.backend, args.group, args.hz, args.proc_root, args.kernel_headers, gpu_grace=5.0,
                            host_root=args.host_root, kubelet=_kubelet(args, default_node()),
                            bpf_stats=args.bpf_stats)  # fmt: skip
    try:
        sampler.gpus.wait_ready(30.0)
        sampler.prime(min(1.0, args.duration))
        summary = sampler.run_window(args.duration)
    finally:
        _close(sampler)
    print(json.dumps(summary, indent=2) if args.json else render(summary))
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    """The control plane (embedded history, pages, /metrics) and an agent on
    this machine, as two child processes, until Ctrl-C or SIGTERM."""
    import secrets
    import subprocess
    import tempfile

    from controlplane.ingest.tokens import node_token
    from controlplane.server import split_address
    from sampler.agent import default_node

    try:
        host, port = split_address(args.listen)
    except ValueError as e:
        _fail(EXIT_USAGE, f"--listen {e}")
    if port in (0, 65535):
        _fail(EXIT_USAGE, f"--listen {args.listen}: a fixed port below 65535 is needed (the agents' is the next one)")
    node = default_node()
    work = Path(tempfile.mkdtemp(prefix="nodesampler-up-"))
    secret = secrets.token_hex(32).encode()
    (work / "secret").write_bytes(secret)
    (work / "token").write_text(node_token(secret, node))
    for f in ("secret", "token"):
        (work / f).chmod(0o600)
    me = [sys.executable, "-m", "nodesampler"]
    agent_addr = f"{host}:{port + 1}"
    children: list[subprocess.Popen[bytes]] = []
    _stop_on_sigterm()
    try:
        cp = subprocess.Popen([*me, "controlplane", "--listen", agent_addr, "--pages-listen", args.listen,
                               "--secret-file", str(work / "secret")], stdout=subprocess.PIPE)  # fmt: skip
        children.append(cp)
        assert cp.stdout is not None
        if not cp.stdout.readline():
            _fail(1, "the control plane did not start (is the address taken?)")
        children.append(subprocess.Popen([*me, "agent", "--control-plane", f"http://{agent_addr}", "--token-file",
                                          str(work / "token"), "--node", node, "--hz", f"{args.hz:g}",
                                          "--interval", f"{args.interval:g}"]))  # fmt: skip
        print(f"nodesampler {__version__} is up: open http://{args.listen}/ (node {node}; Ctrl-C stops)", flush=True)
        while all(c.poll() is None for c in children):
            time.sleep(0.5)
        _fail(1, "a child process stopped; stopping the other")
    except KeyboardInterrupt:
        return 0
    finally:
        for c in children:
            if c.poll() is None:
                c.terminate()
        for c in children:
            try:
                c.wait(timeout=15)
            except subprocess.TimeoutExpired:
                c.kill()


def cmd_agent(args: argparse.Namespace) -> int:
    import asyncio
    import ssl
    import threading

    import wire
    from sampler.agent import Agent, AgentFailed, ConfigError, ConfigFile, TokenFile, default_node
    from sampler.sources import host_view

    logging.getLogger().setLevel(logging.INFO)
    # First, while this is the only thread: later threads inherit the host's cgroup paths.
    host_view.join_host_cgroup_namespace(args.proc_root, args.host_root)

    node = args.node or default_node()
    try:
        wire.node_id(node)
    except wire.WireError:
        _fail(EXIT_USAGE, f"--node {node!r}: letters, digits, '.', '-' or '_' only")
    if not args.control_plane.startswith(("http://", "https://")):
        _fail(EXIT_USAGE, f"--control-plane {args.control_plane!r}: expected an http:// or https:// URL")
    try:
        token = TokenFile(args.token_file)
    except (OSError, ValueError) as e:
        _fail(EXIT_USAGE, f"--token-file: {e}")
    context = None
    if args.ca_file is not None:
        if not args.control_plane.startswith("https://"):
            _fail(EXIT_USAGE, "--ca-file is for an https:// control plane")
        try:
            context = ssl.create_default_context(cafile=str(args.ca_file))
        except (OSError, ssl.SSLError) as e:
            _fail(EXIT_USAGE, f"--ca-file {args.ca_file}: {e}")
    config = None
    if args.config is not None:
        try:
            config = ConfigFile(args.config)
        except (OSError, ConfigError) as e:
            _fail(EXIT_USAGE, f"--config: {e}")
    stopping = threading.Event()

    def sleep(seconds: float) -> None:
        stopping.wait(seconds)

    sampler = _make_sampler(args.backend, [], args.hz, args.proc_root, args.kernel_headers, sleep=sleep, node=node,
                            host_root=args.host_root, kubelet=_kubelet(args, node),
                            bpf_stats=args.bpf_stats)  # fmt: skip
    if config is not None:
        sampler.specs = config.specs
    logging.getLogger().setLevel(logging.INFO)
    try:
        agent = Agent(sampler, args.control_plane, token, node, args.interval, stopping, config, context,
                      host_view.host_name(args.proc_root, args.host_root), args.alive_file)  # fmt: skip
        asyncio.run(agent.run())
    except AgentFailed as e:
        # The traceback is in the log already: one line more, and the supervisor restarts us.
        print(f"nodesampler: error: {e}", file=sys.stderr)
        return 1
    finally:
        _close(sampler)
    return 0


def _authenticator(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from controlplane.ingest import node_identity as ni
    from controlplane.ingest.tokens import TokenError, read_secret

    if args.secret_file is None and args.k8s_jwks is None:
        _fail(EXIT_USAGE, "--secret-file or --k8s-jwks (or both) is needed: nodes must prove who they are")
    if args.k8s_issuer and args.k8s_jwks is None:
        _fail(EXIT_USAGE, "--k8s-issuer without --k8s-jwks: the issuer's keys are needed")
    secret = None
    if args.secret_file is not None:
        try:
            secret = read_secret(args.secret_file)
        except TokenError as e:
            _fail(EXIT_USAGE, str(e))
    verifier = None
    if args.k8s_jwks is not None:
        if not args.k8s_issuer:
            _fail(EXIT_USAGE, "--k8s-jwks needs --k8s-issuer (the tokens' iss)")
        if not args.k8s_jwks.startswith(("http://", "https://")) and not Path(args.k8s_jwks).is_file():
            _fail(EXIT_USAGE, f"--k8s-jwks {args.k8s_jwks}: no such file (or give an https:// URL)")
        try:
            namespace, name = ni.parse_service_account(args.k8s_service_account)
        except ValueError as e:
            _fail(EXIT_USAGE, f"--k8s-service-account {e}")
        rules = ni.ServiceAccountRules(args.k8s_issuer, args.k8s_audience, namespace, name)
        verifier = ni.ServiceAccountVerifier(ni.JwksSource(args.k8s_jwks), rules)
    return ni.NodeAuthenticator(secret, verifier)


def cmd_controlplane(args: argparse.Namespace) -> int:
    import asyncio
    import gc
    import ssl

    from controlplane.listen.connection_limits import ConnectionLimits
    from controlplane.listen.tls_files import ReloadingServerTLS, TlsSettings
    from controlplane.listen.web_config import ReloadingWebConfig, WebConfigError
    from controlplane.live import LiveSamples
    from controlplane.server import serve, split_address
    from controlplane.state.starvation import StarvationRules
    from web.pages import add_pages

    if args.state_file is not None and not args.state_file.parent.is_dir():
        _fail(EXIT_USAGE, f"--state-file {args.state_file}: {args.state_file.parent} is not a directory")
    if args.forget_after < args.stale_after:
        _fail(EXIT_USAGE, "--forget-after: at least --stale-after (a node is stale before it is forgotten)")
    if args.max_shards_per_node < 1:
        _fail(EXIT_USAGE, "--max-shards-per-node: at least 1")
    if args.prometheus is not None and not args.prometheus.startswith(("http://", "https://")):
        _fail(EXIT_USAGE, f"--prometheus {args.prometheus!r}: expected an http:// or https:// URL")
    for flag, value in (("--listen", args.listen), ("--pages-listen", args.pages_listen)):
        try:
            split_address(value)
        except ValueError as e:
            _fail(EXIT_USAGE, f"{flag} {e}")
    auth = _authenticator(args)
    tls = None
    if (args.tls_cert is None) != (args.tls_key is None):
        _fail(EXIT_USAGE, "--tls-cert and --tls-key go together")
    if args.tls_cert is not None and args.web_config_file is not None:
        _fail(EXIT_USAGE, "--tls-cert/--tls-key and --web-config-file: give one (the file's TLS is both listeners')")
    if args.tls_cert is not None:
        try:
            tls = ReloadingServerTLS(TlsSettings(args.tls_cert, args.tls_key))
        except (OSError, ssl.SSLError) as e:
            _fail(EXIT_USAGE, f"--tls-cert/--tls-key: {e}")
    web_config = None
    if args.web_config_file is not None:
        try:
            web_config = ReloadingWebConfig(args.web_config_file)
        except (OSError, WebConfigError) as e:
            _fail(EXIT_USAGE, f"--web-config-file {args.web_config_file}: {e}")
        tls = web_config.tls
    for name in args.pages_host:
        if not name or any(c in name for c in "/ @?#"):
            _fail(EXIT_USAGE, f"--pages-host {name!r}: a host name (no scheme, port or path)")
    if args.admin_socket is not None and not args.admin_socket.parent.is_dir():
        _fail(EXIT_USAGE, f"--admin-socket {args.admin_socket}: {args.admin_socket.parent} is not a directory")
    logging.getLogger().setLevel(logging.INFO)
    # The cyclic GC less often: a full collection scans every heartbeat the
    # registry holds (65 ms at 1,000 nodes) and, at Python's thresholds, page
    # views' short-lived objects set one off every second or two, each a pause
    # of the loop that takes heartbeats (p99 63 ms against 39 ms like this,
    # bench/abuse_control_plane.py). The objects that die young are not cyclic.
    gc.set_threshold(10_000, 20, 20)
    try:
        rules = StarvationRules(args.starved_throttled_ratio, args.starved_wait_ratio, args.starved_min_wait,
                                args.host_bound_gpu_utilization)  # fmt: skip
        limits = ConnectionLimits(args.request_deadline, args.idle_timeout, args.max_connections_per_peer)
        asyncio.run(serve(args.listen, args.pages_listen, auth, args.stale_after, args.prometheus, tls, rules, limits,
                          args.max_shards_per_node, args.state_file, args.forget_after, add_routes=add_pages,
                          live=LiveSamples(args.max_live_nodes, args.live_linger) if args.max_live_nodes else None,
                          heartbeat_rate=args.max_heartbeats_per_second, web_config=web_config,
                          pages_hosts=args.pages_host, admin_socket=args.admin_socket))
    except OSError as e:  # the address is taken or not ours
        _fail(EXIT_USAGE, f"cannot listen: {e}")
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    """DELETE /api/nodes/NODE through the admin socket: 0 forgotten, 1 not (the control plane's answer says why)."""
    import http.client
    import socket

    class _UnixConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            sock.connect(str(args.admin_socket))
            self.sock = sock

    conn = _UnixConnection("localhost", timeout=30)
    try:
        conn.request("DELETE", f"/api/nodes/{urllib.parse.quote(args.node, safe='')}")
        r = conn.getresponse()
        body = r.read(4096).decode(errors="replace").strip()
    except OSError as e:
        _fail(1, f"--admin-socket {args.admin_socket}: {e} (is the control plane running with --admin-socket?)")
    finally:
        conn.close()
    if r.status != 200:
        _fail(1, f"node {args.node!r} not forgotten: {r.status} {body}")
    print(f"forgot {args.node}")
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    from controlplane.ingest.tokens import TokenError, node_token, read_secret

    try:
        print(node_token(read_secret(args.secret_file), args.node))
    except TokenError as e:
        _fail(EXIT_USAGE, str(e))
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="nodesampler: %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    commands = {"sample": cmd_sample, "up": cmd_up, "agent": cmd_agent, "controlplane": cmd_controlplane,
                "token": cmd_token, "forget": cmd_forget}  # fmt: skip
    try:
        return commands[args.command](args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`): nothing more to say, and no traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
