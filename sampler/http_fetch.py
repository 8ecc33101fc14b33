"""One bounded HTTP GET from the sampler's threads: the whole body within a
deadline and a size cap, or a `FetchError` saying why, in one line.

Engines' metrics endpoints and the kubelet are read with it; neither may
hold a sampler's thread longer than its deadline, whatever it sends.
"""

from __future__ import annotations

import ssl
import time
import urllib.error
import urllib.request


class FetchError(Exception):
    """Why a fetch gave no body."""


def fetch(url: str, deadline_s: float, max_bytes: int, headers: dict[str, str] | None = None,
          context: ssl.SSLContext | None = None) -> bytes:  # fmt: skip
    """The body at `url`, whole within the deadline and the size cap."""
    end = time.monotonic() + deadline_s
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=deadline_s, context=context) as r:  # noqa: S310 (callers check the scheme)
            chunks, size = [], 0
            # read1: what one read of the socket gives, so a server that drips
            # a byte at a time meets the deadline between reads.
            while chunk := r.read1(65536):
                size += len(chunk)
                if size > max_bytes:
                    raise FetchError(f"more than {max_bytes >> 20} MiB")
                if time.monotonic() > end:
                    raise FetchError(f"not whole within {deadline_s:g} s")
                chunks.append(chunk)
    except urllib.error.HTTPError as e:
        raise FetchError(f"HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise FetchError(f"{type(reason).__name__}: {reason}") from None
    return b"".join(chunks)
