"""Heartbeats and registrations coming in: the agent-facing API (agent_api) and
who may speak for which node (node_identity, tokens)."""
