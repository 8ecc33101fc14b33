"""Where the control plane's replicas are: URLs as given, or a DNS SRV
record that lists them, re-read while running.

`--control-plane` (the agent's) and `--peer` (a replica's) each take a URL,
or `dnssrv+NAME` (`dnssrv+http://NAME` for a replica without TLS), as
Prometheus and Thanos spell SRV discovery: NAME's SRV records, each
`TARGET:PORT`, become `https://TARGET:PORT`. A
Kubernetes headless Service publishes one a named port and replica
(`_agents._tcp.nodesampler-controlplane.nodesampler.svc.cluster.local`
answers `nodesampler-controlplane-N.nodesampler-controlplane.nodesampler.
svc.cluster.local` for each replica), so a StatefulSet scaled from three to
five is found by every agent without a change to its flags.

Every process that reads the same records makes the same URLs (targets
without their trailing dot, sorted), so every agent ranks the same
replicas for its node (sampler/agent/replicas.py). A lookup that fails
keeps the replicas the record last named: a DNS server's bad minute moves
no node; a record that never resolved names none yet (its process says
so, and tries again every `REFRESH_S`).
"""

from __future__ import annotations

import logging
import re
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import dns.asyncresolver

# dnspython is imported where a record is read: a process given URLs alone (every
# `nodesampler sample`, an agent in the kernel tests' guests) does not need it.

log = logging.getLogger(__name__)

SRV = "dnssrv+"
REFRESH_S = 30.0  # a replica added or gone is found within this (Prometheus' dns_sd default refresh)
LOOKUP_TIMEOUT_S = 5.0
MAX_RECORDS = 64  # replicas one record may name: more is no fleet's control plane
# A DNS host name (RFC 1123 labels, dot-joined): what an SRV target may be to become a URL's host.
HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def _record(url: str) -> str:
    """`dnssrv+NAME` is `dnssrv+https://NAME`: a replica is reached over TLS unless the record says otherwise."""
    inner = url.removeprefix(SRV)
    return inner if "://" in inner else f"https://{inner}"


def scheme(url: str) -> str:
    """The scheme the replicas `url` names are reached by."""
    return urllib.parse.urlsplit(_record(url) if url.startswith(SRV) else url).scheme


def check(url: str) -> str | None:
    """Why `url` is neither an http(s) URL nor a `dnssrv+[http(s)://]NAME`; None when it is one."""
    inner = _record(url) if url.startswith(SRV) else url
    parts = urllib.parse.urlsplit(inner)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "expected an http:// or https:// URL, or dnssrv+https://NAME (a DNS SRV record)"
    if url.startswith(SRV) and (parts.port is not None or parts.path not in ("", "/") or parts.query):
        return "dnssrv+: the record's name alone (its records name each replica's host and port)"
    return None


class NoReplicas(LookupError):
    """A record that names no replica (every port 0: a Service without endpoints)."""


class Replicas:
    """The replicas a list of URLs and SRV records names now (`urls`), in
    the order given, each once; `refresh` reads the records again."""

    def __init__(self, given: Sequence[str], resolver: dns.asyncresolver.Resolver | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.given = list(dict.fromkeys(u.rstrip("/") for u in given))
        self._resolver, self.clock = resolver, clock
        self._found: dict[str, list[str]] = {u: [] for u in self.given if u.startswith(SRV)}
        self._errors: dict[str, str | None] = {}
        self.refreshed_at: float | None = None

    @property
    def discovered(self) -> bool:
        return bool(self._found)

    @property
    def urls(self) -> list[str]:
        out: list[str] = []
        for url in self.given:
            out += self._found.get(url, []) if url.startswith(SRV) else [url]
        return list(dict.fromkeys(out))

    async def refresh(self) -> bool:
        """Each record read again; whether the replicas changed."""
        import dns.exception
        before = self.urls
        for record in self._found:
            try:
                self._found[record] = await self._lookup(record)
                error = None
            except (NoReplicas, dns.exception.DNSException) as e:
                error = f"{type(e).__name__}: {e}"[:300]
            if error != self._errors.get(record):
                if error is None:
                    log.info("%s names %d replicas: %s", record, len(self._found[record]),
                             ", ".join(self._found[record]))  # fmt: skip
                else:
                    kept = self._found[record]
                    log.warning("%s: %s (%s)", record, error, f"keeping the {len(kept)} replicas it named"
                                if kept else "no replica known from it yet")  # fmt: skip
                self._errors[record] = error
        self.refreshed_at = self.clock()
        return self.urls != before

    async def _lookup(self, record: str) -> list[str]:
        import dns.asyncresolver
        import dns.rdatatype

        parts = urllib.parse.urlsplit(_record(record))
        resolver = self._resolver or dns.asyncresolver.get_default_resolver()
        answer = await resolver.resolve(parts.hostname or "", dns.rdatatype.SRV, lifetime=LOOKUP_TIMEOUT_S)
        found, bad = set(), 0
        for r in answer:
            target = r.target.to_text(omit_final_dot=True)
            if not r.port:
                continue
            if not HOST_NAME.fullmatch(target):  # a `/`, `@` or `:` in a target would move the URL's host
                bad += 1
                continue
            found.add(urllib.parse.urlunsplit((parts.scheme, f"{target}:{r.port}", "", "", "")))
        if bad:
            log.warning("%s: %d SRV targets are not host names: left out", record, bad)
        if not found:
            raise NoReplicas("no SRV record with a port and a host name")
        if len(found) > MAX_RECORDS:
            log.warning("%s names %d replicas: the first %d (sorted) are used", record, len(found), MAX_RECORDS)
        return sorted(found)[:MAX_RECORDS]
