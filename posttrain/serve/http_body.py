"""Reading a request body on the standard library's HTTP server, never more than a limit.

``Content-Length`` is checked (digits only, at most the limit), a chunked body is decoded up to
the limit, and a body that ends early or stalls is refused: whatever the headers say, no more
than ``limit`` bytes are held, and no read waits past the connection's timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from email.message import Message
from typing import BinaryIO

PIECE = 1 << 20
MAX_CHUNK_LINE = 1024


def read_body(rfile: BinaryIO, headers: Message, limit: int,
              refuse: Callable[[int, str], Exception]) -> bytes:
    """The body's bytes; raises ``refuse(status, message)`` for a body it will not read."""
    encoding = (headers.get("Transfer-Encoding") or "").strip().lower()
    length = headers.get("Content-Length")
    try:
        if encoding:
            if encoding != "chunked":
                raise refuse(501, f"Transfer-Encoding {encoding!r} is not supported (only chunked)")
            if length is not None:
                raise refuse(400, "give Content-Length or Transfer-Encoding: chunked, not both")
            return _chunked(rfile, limit, refuse)
        if length is None or not length.strip():
            return b""
        length = length.strip()
        if not length.isdigit() or not length.isascii():
            raise refuse(400, f"bad Content-Length {length[:20]!r}: must be a number of bytes (0 or more)")
        if len(length) > 20 or int(length) > limit:
            raise refuse(413, f"request body over the limit of {limit} bytes (Content-Length {length[:20]})")
        return _exactly(rfile, int(length), refuse)
    except TimeoutError:
        raise refuse(408, "the request body did not arrive in time") from None


def _exactly(rfile: BinaryIO, size: int, refuse: Callable[[int, str], Exception]) -> bytes:
    out = bytearray()
    while len(out) < size:
        piece = rfile.read(min(PIECE, size - len(out)))
        if not piece:
            raise refuse(400, f"the request body ended after {len(out)} of {size} bytes (Content-Length)")
        out += piece
    return bytes(out)


def _chunked(rfile: BinaryIO, limit: int, refuse: Callable[[int, str], Exception]) -> bytes:
    out = bytearray()
    while True:
        line = rfile.readline(MAX_CHUNK_LINE + 1)
        if len(line) > MAX_CHUNK_LINE or not line.endswith(b"\n"):
            raise refuse(400, "bad chunk in a chunked request body")
        size_text = line.split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise refuse(400, "bad chunk size in a chunked request body") from None
        if size < 0 or size_text.startswith((b"-", b"+")):
            raise refuse(400, "bad chunk size in a chunked request body")
        if size == 0:
            while rfile.readline(MAX_CHUNK_LINE + 1) not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return bytes(out)
        if len(out) + size > limit:
            raise refuse(413, f"request body over the limit of {limit} bytes (chunked)")
        out += _exactly(rfile, size, refuse)
        if rfile.readline(MAX_CHUNK_LINE + 1) not in (b"\r\n", b"\n"):
            raise refuse(400, "bad chunk in a chunked request body")
