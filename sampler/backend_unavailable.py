"""The one error every way of counting engines' CPU time raises when it
cannot run here; its message says why (sampler/backend.py chooses the
backend on it)."""


class BackendUnavailable(Exception):
    """The backend asked for cannot run here; the message says why."""
