"""Typed keys of the control plane's aiohttp applications: values of several
stages that both listeners' apps hold. Their types are imported for the
type checker alone, so any stage may import these keys and no import runs
back up (DESIGN: "Layout")."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from controlplane.export.exposition import FleetExposition
    from controlplane.export.own_metrics import ControlPlaneMetrics
    from controlplane.history.backends import EmbeddedHistory, History
    from controlplane.ingest.node_identity import NodeAuthenticator
    from controlplane.state.registry import NodeRegistry

REGISTRY: web.AppKey[NodeRegistry] = web.AppKey("registry")
AUTHENTICATOR: web.AppKey[NodeAuthenticator] = web.AppKey("authenticator")
METRICS: web.AppKey[ControlPlaneMetrics] = web.AppKey("metrics")
EXPOSITION: web.AppKey[FleetExposition] = web.AppKey("exposition")
RECORDER: web.AppKey[EmbeddedHistory] = web.AppKey("recorder")  # the embedded history, fed by heartbeats
# What the pages' charts read: the embedded history (the same object as RECORDER), or Prometheus.
HISTORY: web.AppKey[History] = web.AppKey("history")
