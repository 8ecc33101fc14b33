"""`nodesampler agent`: sample this node window after window and deliver each
window's summary to the control plane as a heartbeat.

Its modules, in the order a window travels: `config` (the files the agent
reads while it runs: its shards, its token), `run` (the agent: the sampling
thread and the sender), `delivery` (the newest summary waiting, the backoff
between tries) and `client` (the control plane's API as the agent speaks it).
"""
