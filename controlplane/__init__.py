"""The control plane: node registry, heartbeat API, Prometheus collector, history."""
