"""Cluster and node pages."""
