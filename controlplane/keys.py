"""Typed keys of the control plane's aiohttp applications."""

from aiohttp import web

from controlplane.registry import NodeRegistry

REGISTRY = web.AppKey("registry", NodeRegistry)
SECRET = web.AppKey("secret", bytes)
