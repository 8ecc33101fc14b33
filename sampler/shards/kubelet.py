"""This node's pods, from its kubelet's `/pods`: the pods the kubelet runs,
their labels and their containers' ids, without a word to the API server.

A daemon thread polls every `POLL_S`, and sooner (at most every
`REFRESH_S`) when the sampler meets a container the last answer does not
name (a pod started or restarted since). The last good answer is kept
through a kubelet that fails, times out or answers nonsense: a sample never
waits for the kubelet, and a broken kubelet costs one request per poll and
one log line per change of reason.

The request carries the service account's token (re-read each time: the
kubelet rotates it); the kubelet checks it with the API server and
authorises `get` on `nodes/pods` (the shipped ClusterRole; `nodes/proxy`
before Kubernetes 1.36's fine-grained kubelet authorization).

The token goes only to a kubelet that proves it is this node's: its
certificate must chain to the CA given (the cluster's, when kubelets serve
certificates it signed: `serverTLSBootstrap`), name the address asked, and,
when it is a kubelet-serving certificate (organisation `system:nodes`),
name this node (`system:node:NODE`): another node's kubelet at a reused
address is refused. Self-signed kubelets can only be read unverified, by
an explicit opt-out that the agent's log says at start.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sampler.shards.http_fetch import FetchError, fetch
from sampler.shards.pods import Pod, parse_pod_list

log = logging.getLogger(__name__)

POLL_S = 10.0
REFRESH_S = 2.0
DEADLINE_S = 5.0
UNKNOWN_TTL_S = 60.0
MAX_UNKNOWN = 65536
MAX_BYTES = 64 << 20  # 110 pods of large specs are a few MiB
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def tls_context(ca_file: Path | None, verify: bool = True) -> ssl.SSLContext:
    """Verified against `ca_file` (the system's trust store without one);
    `verify=False` is the opt-out for kubelets with self-signed certificates."""
    if not verify:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    return ssl.create_default_context(cafile=None if ca_file is None else str(ca_file))


def node_check(node: str) -> Callable[[dict[str, Any]], str | None]:
    """Refuses a kubelet-serving certificate (organisation `system:nodes`,
    the only kind the cluster's kubelet-serving signer issues) for any node
    but `node`."""

    def check(cert: dict[str, Any]) -> str | None:
        subject = {k: v for rdn in cert.get("subject", ()) for k, v in rdn}
        if subject.get("organizationName") != "system:nodes":
            return None  # not the cluster's kubelet-serving kind: its chain and address vouch for it
        if subject.get("commonName") != f"system:node:{node}":
            return f"the kubelet's certificate is {subject.get('commonName')!r}'s, not system:node:{node}'s"
        return None

    return check


class KubeletPods:
    def __init__(self, url: str, token_file: Path | None, ca_file: Path | None = None,
                 poll_s: float = POLL_S, refresh_s: float = REFRESH_S, deadline_s: float = DEADLINE_S,
                 clock: Callable[[], float] = time.monotonic, node: str | None = None,
                 verify: bool = True) -> None:  # fmt: skip
        if not url.startswith(("https://", "http://")):
            raise ValueError(f"kubelet URL {url!r}: expected https://HOST:PORT")
        self.url = url.rstrip("/") + "/pods"
        self.token_file = token_file
        self.poll_s, self.refresh_s, self.deadline_s = poll_s, refresh_s, deadline_s
        self._context = tls_context(ca_file, verify) if url.startswith("https://") else None
        self._peer_check = node_check(node) if node is not None else None
        self._clock = clock
        self._pods: list[Pod] | None = None
        self._error: str | None = None
        self._polls = 0  # answers and failures so far
        self._asked_at = -float("inf")
        self._unknown: dict[str, float] = {}  # container id -> when first met unnamed
        self._polled_from = -float("inf")  # when the last poll to end began
        self._changed = threading.Condition()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            if self._context is not None and self._context.verify_mode == ssl.CERT_NONE:
                log.warning("kubelet %s: its certificate is NOT verified (--kubelet-insecure-skip-tls-verify): "
                            "the pod's token goes to whatever answers there", self.url)  # fmt: skip
            self._thread = threading.Thread(target=self._run, name="kubelet-pods", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()

    def pods(self) -> list[Pod] | None:
        """The last good answer; None before the first."""
        self.start()
        return self._pods

    @property
    def error(self) -> str | None:
        """Why the last poll failed; None when it answered."""
        return self._error

    def refresh(self) -> None:
        """Poll soon: a container no pod of the last answer names was met.
        At most once every `refresh_s`, so an unknown container (one of
        Kubernetes' own, or a process in a cgroup named like one) costs nothing."""
        now = self._clock()
        if now - self._asked_at >= self.refresh_s:
            self._asked_at = now
            self._wake.set()

    def note_unknown(self, ids: set[str]) -> None:
        """Containers met on the node that the last answer does not name.
        Each asks for a poll until one that began after it was first met has
        ended; after that it is taken for what it is (a pod's sandbox, or a
        container that is no pod's) until `UNKNOWN_TTL_S` has passed."""
        now = self._clock()
        for cid in [c for c, seen in self._unknown.items() if now - seen > UNKNOWN_TTL_S or c not in ids]:
            del self._unknown[cid]
        for cid in ids - self._unknown.keys():
            if len(self._unknown) < MAX_UNKNOWN:
                self._unknown[cid] = now
        if any(seen > self._polled_from for seen in self._unknown.values()):
            self.refresh()

    def wait_for_poll(self, after: int, timeout: float) -> int:
        """Block until more than `after` polls have ended (tests, and a
        one-shot `sample` that needs its pods); the count of polls."""
        self.start()
        with self._changed:
            self._changed.wait_for(lambda: self._polls > after, timeout)
            return self._polls

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before the poll: a refresh asked during it polls again at once
            self._poll_once()
            self._wake.wait(self.poll_s)

    def _poll_once(self) -> None:
        began, error = self._clock(), None
        try:
            headers = {"Accept": "application/json"}
            if self.token_file is not None:
                headers["Authorization"] = "Bearer " + self.token_file.read_text().strip()
            pods = parse_pod_list(fetch(self.url, self.deadline_s, MAX_BYTES, headers, self._context, self._peer_check),
                                  lambda why: log.debug("kubelet: %s", why))  # fmt: skip
        except (FetchError, ValueError, OSError) as e:
            error = f"kubelet {self.url}: {e}"
        with self._changed:
            if error is None:
                self._pods = pods
                if self._error is not None:
                    log.info("kubelet %s answers again: %d pods", self.url, len(pods))
            elif error != self._error:
                log.warning("%s (the last answer is kept)", error)
            self._error = error
            self._polled_from = began
            self._polls += 1
            self._changed.notify_all()
