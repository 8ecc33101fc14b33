"""The node agent: /proc (and, later, kernel) backends, window summaries."""
