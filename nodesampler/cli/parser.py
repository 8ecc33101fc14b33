"""The command line: every command's flags, and the one-line refusal of a misuse (exit code 2)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from nodesampler import __version__

EXIT_USAGE = 2


EXIT_BACKEND = 3


ADMIN_SOCKET = "/run/nodesampler/admin.sock"  # where the shipped Deployment puts the control plane's


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
    a.add_argument("--control-plane", required=True, action="append", metavar="URL",
                   help="the control plane's agent listener; repeated: one a replica, the node held by the first "
                        "of its order (rendezvous hashing) that answers")
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
    a.add_argument("--hindsight", type=_within(0, 1440), default=15.0, metavar="MINUTES",
                   help="keep every sample of the last MINUTES on the node, for the control plane to fetch after "
                        "the fact (default 15; 0: none kept)")  # fmt: skip
    a.add_argument("--hindsight-mib", type=_positive(4096), default=16.0, metavar="N",
                   help="the memory hindsight may use, MiB: at high rates it keeps fewer minutes, and says how "
                        "many (default 16)")  # fmt: skip
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
    c.add_argument("--incidents-dir", type=Path, default=None, metavar="DIR",
                   help="keep incidents (every sample of the nodes an alert or a starved engine names, from 5 minutes "
                        "before to a minute after) in this directory (default: PATH.incidents beside --state-file; "
                        "with neither, no incidents are kept)")
    c.add_argument("--incidents-mib", type=_count(1 << 20), default=512, metavar="N",
                   help="the incidents' samples on disk, oldest dropped first; at most 64 of them one node's "
                        "(default 512)")  # fmt: skip
    c.add_argument("--incident-before", type=_positive(3000), default=300.0, metavar="S",
                   help="an incident's samples start this many seconds before the alert or the verdict (default "
                        "300; what the nodes' rings hold bounds it)")
    c.add_argument("--incident-after", type=_positive(600), default=60.0, metavar="S",
                   help="... and end this many seconds after it (default 60)")
    c.add_argument("--peer", action="append", default=[], metavar="URL",
                   help="another replica's pages listener (repeatable; the same list for every replica, its own "
                        "included; https, or http on loopback alone): replicas tell each other which nodes they "
                        "hold, and let go of a node that moved")
    c.add_argument("--peer-secret-file", type=Path, default=None, metavar="PATH",
                   help="the secret replicas sign their requests with (default: --secret-file's); on Kubernetes, "
                        "where agents show service-account tokens and no node token is made, a Secret of its own")
    c.add_argument("--peer-ca-file", type=Path, default=None, metavar="PATH",
                   help="CA bundle (PEM) an https peer's certificate must chain to (default: the system's)")
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
    c.add_argument("--card-held-back-ratio", type=_within(0, 1), default=0.5, metavar="R",
                   help="card held back: one of its cards' clocks held back by power or heat over this share of the "
                        "window while it had requests waiting (default 0.5)")  # fmt: skip

    f = sub.add_parser("forget", help="forget a node gone for good, through the control plane's admin socket")
    f.add_argument("node", metavar="NODE")
    f.add_argument("--force", action="store_true",
                   help="forget it though it was heard within --stale-after (its agent registers it again)")
    f.add_argument("--admin-socket", type=Path, default=Path(ADMIN_SOCKET), metavar="PATH",
                   help=f"the control plane's --admin-socket (default {ADMIN_SOCKET})")

    k = sub.add_parser("kube-secrets", help="write the files the Kubernetes manifests' Secrets are generated from")
    k.add_argument("directory", type=Path, metavar="DIR",
                   help="where (deploy/kubernetes/secrets for the shipped kustomization); a file there is kept")

    t = sub.add_parser("token", help="print a node's token, derived from the cluster secret")
    t.add_argument("node", metavar="NODE")
    t.add_argument("--secret-file", required=True, type=Path, metavar="PATH", help="the cluster secret")

    u = sub.add_parser("up", help="the control plane and an agent on this machine, with the pages")
    u.add_argument("--listen", default="127.0.0.1:8080", metavar="ADDR",
                   help="HOST:PORT of the pages (default 127.0.0.1:8080); agents talk to PORT+1")
    u.add_argument("--hz", type=_positive(1000), default=10.0, help="samples a second (default 10)")
    u.add_argument("--interval", type=_positive(3600), default=5.0, help="seconds per heartbeat (default 5)")
    u.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                   help="where the nodes known, the incidents, the admin socket, the cluster secret and the "
                        "node's token are kept (default $XDG_STATE_HOME/nodesampler, else ~/.local/state/nodesampler)")
    u.add_argument("--state-file", type=Path, default=None, metavar="PATH",
                   help="the nodes known, kept across restarts (default STATE_DIR/registry.json)")
    u.add_argument("--incidents-dir", type=Path, default=None, metavar="DIR",
                   help="where incidents are written (default STATE_DIR/incidents)")
    u.add_argument("--web-config-file", type=Path, default=None, metavar="PATH",
                   help="the control plane's web config: TLS for both listeners and the pages' users")
    u.add_argument("--tls-cert", type=Path, default=None, metavar="PATH", help="TLS certificate of the agent listener")
    u.add_argument("--tls-key", type=Path, default=None, metavar="PATH", help="its private key")
    u.add_argument("--ca-file", type=Path, default=None, metavar="PATH",
                   help="the CA the agent trusts for that certificate (default: the system's CAs)")
    return p


def fail(code: int, message: str) -> NoReturn:
    print(f"nodesampler: error: {message}", file=sys.stderr)
    raise SystemExit(code)
