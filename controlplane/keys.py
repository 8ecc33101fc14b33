"""Typed keys of the control plane's aiohttp applications."""

from aiohttp import web

from controlplane.export.exposition import FleetExposition
from controlplane.export.own_metrics import ControlPlaneMetrics
from controlplane.history import EmbeddedHistory, History
from controlplane.ingest.node_identity import NodeAuthenticator
from controlplane.state.registry import NodeRegistry

REGISTRY = web.AppKey("registry", NodeRegistry)
AUTHENTICATOR = web.AppKey("authenticator", NodeAuthenticator)
METRICS = web.AppKey("metrics", ControlPlaneMetrics)
EXPOSITION = web.AppKey("exposition", FleetExposition)
RECORDER = web.AppKey("recorder", EmbeddedHistory)  # the embedded history, fed by heartbeats
# What the pages' charts read: the embedded history (the same object as RECORDER), or Prometheus.
HISTORY = web.AppKey("history", History)
