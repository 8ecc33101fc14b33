"""Bodies read whole, or refused at their bound: never cut short.

aiohttp's `StreamReader.read(n)` returns what is buffered, at most n bytes:
about 128 KiB when the rest has not arrived yet, not n. Reading a body that
way cut every peer's answer and every request body larger than that short
(a held list of 2,600 nodes, a row list of a few hundred, a webhook of
128 KiB), and JSON that ends mid-string is an error. So a body is read
here to its end, with the declared length checked first and a running cap
while it comes, for requests (a client's, a peer's) and for answers alike.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web


class TooLarge(ValueError):
    """A body over its bound: refused, never read further."""

    def __init__(self, most: int, seen: int) -> None:
        super().__init__(f"a body over {_size(most)} ({_size(seen)} or more)")
        self.most, self.seen = most, seen


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB" if n >= 1024 else f"{n} bytes"


async def read_whole(stream: aiohttp.StreamReader, most: int, declared: int | None = None) -> bytes:
    """`stream` to its end: TooLarge as soon as `declared` (Content-Length)
    or what came so far is over `most` bytes."""
    if declared is not None and declared > most:
        raise TooLarge(most, declared)
    chunks, size = [], 0
    async for chunk in stream.iter_any():  # ends at EOF, whatever each read returned
        size += len(chunk)
        if size > most:
            raise TooLarge(most, size)
        chunks.append(chunk)
    return b"".join(chunks)


async def request_body(request: web.BaseRequest, most: int) -> bytes:
    """A request's body, whole: 413 (which names the bound) when it is over `most` bytes."""
    try:
        return await read_whole(request.content, most, request.content_length)
    except TooLarge as e:
        raise web.HTTPRequestEntityTooLarge(max_size=most, actual_size=e.seen) from None


async def answer_body(response: aiohttp.ClientResponse, most: int) -> bytes:
    """A peer's answer, whole: TooLarge (a ValueError) when it is over `most` bytes."""
    return await read_whole(response.content, most, response.content_length)
