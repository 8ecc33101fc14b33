"""The control plane's agent API as the agent speaks it: register, heartbeat,
and what each answer means (docs/wire-format.md)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import aiohttp

import wire
from sampler.off_thread import Said
from wire.hindsight import SpanRequest, parse_request
from wire.schema import Registration, WindowSummary

log = logging.getLogger(__name__)


class DeliveryError(Exception):
    pass


class Refused(DeliveryError):
    """The control plane answered, and refused (400, 401, 403, 413, 429): not "unreachable"."""


class UnknownToControlPlane(DeliveryError):
    """404: the control plane does not know this node (it restarted)."""


class AlreadyDelivered(DeliveryError):
    """409: the control plane has this window's heartbeat already (the answer
    to the first send was lost), or a later one."""


class Answer(NamedTuple):
    """What the control plane asks for in its answer to a heartbeat."""

    raw: bool  # the next windows' raw samples: someone watches the node live
    span: SpanRequest | None  # a span of hindsight, sent a piece a heartbeat


class HeartbeatClient:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, token: str | Callable[[], str]) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.token = token if callable(token) else (lambda: token)
        self._dropped_said = Said(most=100)

    async def _post(self, path: str, body: Registration | WindowSummary) -> dict[str, Any]:
        """The answer to an accepted body ({} when it cannot be read: it says no more)."""
        headers = {"Authorization": f"Bearer {self.token()}", "Content-Type": "application/json"}
        try:
            async with self.session.post(self.base_url + path, data=wire.encode(body), headers=headers) as r:
                if r.status == 200:
                    answer: Any = {}
                    with contextlib.suppress(ValueError):
                        answer = await r.json(content_type=None)
                    self._say_dropped(answer)
                    return answer if isinstance(answer, dict) else {}
                text = (await r.text())[:300]
        except aiohttp.ClientConnectorCertificateError as e:
            raise DeliveryError(f"TLS: the control plane's certificate is not trusted (--ca-file?): "
                                f"{e.certificate_error}") from None  # fmt: skip
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise DeliveryError(f"{type(e).__name__}: {e}") from None
        if r.status == 404 and path == "/v1/heartbeat":
            raise UnknownToControlPlane(text)
        if r.status == 409 and path == "/v1/heartbeat":
            raise AlreadyDelivered(text)
        if 400 <= r.status < 500:
            raise Refused(f"{path} refused, HTTP {r.status}: {text}")
        raise DeliveryError(f"HTTP {r.status}: {text}")

    def _say_dropped(self, answer: Any) -> None:
        """What the control plane left out of an accepted body: once per reason."""
        dropped = answer.get("dropped") if isinstance(answer, dict) else None
        for d in dropped if isinstance(dropped, list) else []:
            reason = str(d.get("reason"))[:200] if isinstance(d, dict) else "?"
            if self._dropped_said.first(reason):
                log.warning("the control plane left out %s: %s", str(d.get("field"))[:100], reason)

    async def register(self, registration: Registration) -> float | None:
        """Registers the node; the heartbeats a second the control plane takes
        from it (None: it did not say, or takes any number)."""
        answer = await self._post("/v1/register", registration)
        rate = answer.get("max_heartbeats_per_second")
        if isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 < rate < float("inf"):
            return float(rate)
        return None

    async def heartbeat(self, summary: WindowSummary) -> Answer:
        """Sends a window's summary; the answer says whether the control plane
        asks for the next windows' raw samples (someone watches this node
        live), and which span of hindsight it asks for (wire/hindsight.py)."""
        answer = await self._post("/v1/heartbeat", summary)
        try:
            span = parse_request(answer.get("hindsight"))
        except wire.WireError as e:
            span = None
            if self._dropped_said.first(f"hindsight {e.reason}"):
                log.warning("the control plane asked for a span of hindsight this agent cannot read (%s): "
                            "none is sent", e)  # fmt: skip
        return Answer(answer.get("raw") is True, span)
