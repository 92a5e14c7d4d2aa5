"""Request bodies: reading them (size cap, slow-client timeouts, disconnects, shutdown), checking
their media type, and decoding them as strict JSON within the structural limits.

Decoding runs in the server's CPU pool (see cpu_pool.py), never on the event loop. Before
``json.loads`` builds a single object, a scan counts the body's JSON values in windows of
:data:`SCAN_WINDOW` bytes (each a few C calls, so the GIL is released between them) and refuses a
body with more values than :class:`~clef_vllm.schema.protocol.RequestLimits` allows: a million keys or a
600,000-question body costs a few milliseconds to refuse, not gigabytes to parse.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any, Awaitable, Callable

from clef_vllm.schema.errors import ClientClosed, Kind, RequestError, ServiceError
from clef_vllm.schema.protocol import MAX_INT_DIGITS, RequestLimits

#: Bytes scanned per step when counting a body's JSON values.
SCAN_WINDOW = 1 << 20
#: While the server drains (SIGTERM), an upload that sends nothing for this long is refused (503).
DRAIN_STALL_S = 0.5

JSON_TYPES = ("application/json",)
#: Media types the hosted route reads as JSON: also ``curl -d``'s default, as the hosted API
#: accepts it. A cross-site HTML form cannot forge a JSON body in this encoding (``{``, ``"`` and
#: ``:`` arrive percent-encoded), unlike ``text/plain``, which stays refused.
HOSTED_TYPES = JSON_TYPES + ("application/x-www-form-urlencoded",)
#: Media types accepted by the bulk endpoint (one JSON request per line).
NDJSON_TYPES = ("application/x-ndjson", "application/jsonl", "application/json-lines", "application/ndjson")


# --------------------------------------------------------------------------- media type


def check_media_type(content_type: str | None, accepted: tuple[str, ...]) -> None:
    """Refuse (415) a body that is not declared as one of ``accepted`` (parameters allowed; a
    ``charset`` must be UTF-8). A missing Content-Type is refused too: browsers send cross-site
    ``text/plain`` or form posts without a CORS preflight, never ``application/json``."""
    media, _, params = (content_type or "").partition(";")
    media = media.strip().lower()
    if media not in accepted:
        got = f"got {media!r}" if media else "none was given"
        raise RequestError(f"Content-Type must be {' or '.join(accepted)} ({got})", kind=Kind.UNSUPPORTED_MEDIA_TYPE)
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise RequestError(f"charset must be utf-8 (got {value.strip()!r})", kind=Kind.UNSUPPORTED_MEDIA_TYPE)


def check_content_encoding(content_encoding: str | None) -> None:
    """Refuse (415) a body declared compressed or otherwise encoded (``Content-Encoding`` other than
    ``identity``): the server does not decode bodies, and compressed bytes must never be read as JSON."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",") if c.strip()]
    if any(c != "identity" for c in codings):
        raise RequestError(f"Content-Encoding {content_encoding.strip()!r} is not supported: send the body "
                           "uncompressed (identity)", kind=Kind.UNSUPPORTED_MEDIA_TYPE)


# --------------------------------------------------------------------------- reading


def body_too_large(limit: int, what: str = "body", source: str = "--max-body-bytes") -> RequestError:
    return RequestError(f"{what} exceeds {limit} bytes ({source})", kind=Kind.BODY_TOO_LARGE)


def declared_length(declared: str | None, limit: int, source: str = "--max-body-bytes") -> int | None:
    """The body's declared ``Content-Length`` (``None`` when absent or not a number), refused (413)
    when it is over ``limit`` (``source``: what sets it): before a byte of the body is read or accounted."""
    if declared is None or not declared.isdigit():
        return None
    if int(declared) > limit:
        raise body_too_large(limit, source=source)
    return int(declared)


class BodyReader:
    """Reads a request body from ASGI ``receive`` with the slow-client rules:

    * no pause between two pieces of the body longer than ``body_timeout`` seconds;
    * the whole body by ``start + body_timeout + received / min_rate`` (a minimum average rate
      once the first ``body_timeout`` seconds are used up);
    * both count only the time the server waits for bytes (in :meth:`message`), never the time it
      spends elsewhere between two pieces;
    * once ``stopping`` is set (SIGTERM), a body that pauses for :data:`DRAIN_STALL_S` is refused
      with 503; ``abandon`` (the shutdown timeout) refuses it at once.

    Raises RequestError(SLOW_CLIENT), ClientClosed or ServiceError(DRAINING)."""

    def __init__(self, receive: Callable[[], Awaitable[dict]], *, body_timeout: float | None = None,
                 min_rate: float | None = None, stopping: asyncio.Event | None = None,
                 abandon: asyncio.Event | None = None):
        self.receive = receive
        self.body_timeout = body_timeout
        self.min_rate = min_rate
        self.stopping = stopping
        self.abandon = abandon
        self.started = self.last = self.returned = time.monotonic()
        self.busy = 0.0                              # time the server spent between two calls of message()
        self.received = 0
        self.done = False
        #: While this says True the client is waiting for answers: pauses are not counted (bulk).
        self.exempt: Callable[[], bool] | None = None
        self.wake = asyncio.Event()                  # set when ``exempt`` may have changed
        self._waiters: dict[str, asyncio.Future] | None = None
        #: The error for a body that stalls once ``stopping`` is set (shutting down, or the engine died).
        self.stopping_error: Callable[[], Exception] | None = None

    def touch(self) -> None:
        """Restart the pause clock (the client's answers just went out) and re-check the rules."""
        self.last = time.monotonic()
        self.wake.set()

    def _deadline(self, now: float) -> float | None:
        limits = []
        if self.exempt is not None and self.exempt():
            pass
        elif self.body_timeout:
            limits.append(self.last + self.body_timeout)
            if self.min_rate:
                limits.append(self.started + self.busy + self.body_timeout + self.received / self.min_rate)
        if self.stopping is not None and self.stopping.is_set():
            limits.append(self.last + DRAIN_STALL_S)
        return min(limits) if limits else None

    def _interrupts(self) -> list[asyncio.Future]:
        """Waiters for the server's state changes, made once per reader (not once per piece)."""
        if self._waiters is None:
            self._waiters = {}
        for name, event in (("stopping", self.stopping), ("abandon", self.abandon)):
            if event is not None and name not in self._waiters and not event.is_set():
                self._waiters[name] = asyncio.ensure_future(event.wait())
        if self.exempt is not None:
            self.wake.clear()
            waiter = self._waiters.get("wake")
            if waiter is None or waiter.done():
                self._waiters["wake"] = asyncio.ensure_future(self.wake.wait())
        return [w for w in self._waiters.values() if not w.done()]

    def close(self) -> None:
        """Drop the state-change waiters (the body is read, or the request is over)."""
        for waiter in (self._waiters or {}).values():
            waiter.cancel()
        self._waiters = None

    async def message(self) -> dict:
        """The next ASGI message (``http.request`` with its bytes); raises on the rules above.

        Only time spent waiting here counts: bytes the client has already sent are taken even when
        the server was busy past a deadline, and time the server spent between two calls (a bulk
        stream working through its lines) is not the client's pause."""
        entered = time.monotonic()
        self.busy += entered - self.returned
        self.last = max(self.last, entered)
        try:
            while True:
                if self.abandon is not None and self.abandon.is_set():
                    self.close()
                    raise ServiceError("server is shutting down; the request body was not received in time",
                                       kind=Kind.DRAINING)
                got = asyncio.ensure_future(self.receive())
                now = time.monotonic()
                deadline = self._deadline(now)
                # a deadline already passed still gets one look: bytes already here are taken
                await asyncio.wait([got, *self._interrupts()],
                                   timeout=None if deadline is None else max(0.0, deadline - now),
                                   return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    now = time.monotonic()
                    deadline = self._deadline(now)      # the rules may have changed meanwhile (bulk)
                    if deadline is not None and now >= deadline:
                        self.close()
                        raise self._timed_out()
                    continue                            # the server's state changed: re-check
                message = got.result()
                if message["type"] == "http.disconnect":
                    self.close()
                    raise ClientClosed("client closed the connection before sending the whole body")
                chunk = message.get("body", b"")
                if chunk:
                    self.last = time.monotonic()
                    self.received += len(chunk)
                if not message.get("more_body", False):
                    self.done = True
                    self.close()
                return message
        finally:
            self.returned = time.monotonic()

    def _timed_out(self) -> Exception:
        if self.stopping is not None and self.stopping.is_set():
            if self.stopping_error is not None:
                return self.stopping_error()
            return ServiceError("server is shutting down; the request body stalled", kind=Kind.DRAINING)
        rate = f", then at least {self.min_rate:g} bytes/s on average (--min-body-rate)" if self.min_rate else ""
        return RequestError(f"request body too slow: at most {self.body_timeout:g} s without data (--body-timeout)"
                            f"{rate}", kind=Kind.SLOW_CLIENT)

    async def read_all(self, limit: int, declared: str | None = None, limits: RequestLimits | None = None,
                       source: str = "--max-body-bytes") -> bytes:
        """The whole body, refused (413) as soon as it passes ``limit`` bytes (declared or streamed; ``source``:
        what sets it) or, with ``limits``, as soon as it holds more JSON values than they allow (the rest is not
        read)."""
        declared_length(declared, limit, source)
        max_values = limits.max_values if limits is not None else None
        counter, counted = None, 0
        chunks = []
        try:
            while not self.done:
                chunk = (await self.message()).get("body", b"")
                if self.received > limit:
                    raise body_too_large(limit, source=source)
                if chunk:
                    chunks.append(chunk)
                # no body of at most max_values bytes can hold more values: count only past that
                if max_values is not None and self.received > max_values:
                    counter = counter or ValueCounter()
                    for piece in chunks[counted:]:
                        counter.feed(piece)
                    counted = len(chunks)
                    if counter.count > max_values:
                        raise too_many_values(limits)
        finally:
            self.close()
        return b"".join(chunks)


# --------------------------------------------------------------------------- decoding

_QUOTE, _BACKSLASH, _COMMA, _BRACKET, _BRACE = 0x22, 0x5C, 0x2C, 0x5B, 0x7B


class ValueCounter:
    """Counts an upper bound on the JSON values of a body as its pieces arrive: 1 + commas + opening
    brackets outside strings (strings skipped, escaped quotes honoured across pieces). A few numpy
    operations per piece, so a body with too many values is refused after its first megabyte,
    without reading (or buffering) the rest."""

    def __init__(self):
        self.count = 1
        self.inside = False              # the next byte is inside a string
        self.backslashes = 0             # backslashes that ended the previous piece

    def feed(self, piece: bytes | memoryview) -> int:
        import numpy as np

        data = np.frombuffer(piece, dtype=np.uint8)
        if not data.size:
            return self.count
        quotes = np.flatnonzero(data == _QUOTE)
        if quotes.size:                  # drop quotes escaped by an odd run of backslashes
            at = quotes - 1
            odd = np.zeros(quotes.size, dtype=bool)
            active = np.ones(quotes.size, dtype=bool)
            reached = np.zeros(quotes.size, dtype=bool)   # the run goes back to the piece's start
            while active.any():
                before_start = at < 0
                reached |= active & before_start
                active &= ~before_start & (data[np.maximum(at, 0)] == _BACKSLASH)
                odd ^= active
                at -= 1
            if self.backslashes % 2:     # such runs continue into the previous piece
                odd ^= reached
            quotes = quotes[~odd]
        marks = np.flatnonzero((data == _COMMA) | (data == _BRACKET) | (data == _BRACE))
        if marks.size:
            if quotes.size:
                quotes_before = np.searchsorted(quotes, marks)
                self.count += int(np.count_nonzero((quotes_before & 1).astype(bool) == self.inside))
            elif not self.inside:
                self.count += int(marks.size)
        self.inside ^= bool(quotes.size & 1)
        tail = len(data) - 1
        while tail >= 0 and data[tail] == _BACKSLASH:
            tail -= 1
        trailing = len(data) - 1 - tail
        self.backslashes = self.backslashes + trailing if tail < 0 else trailing
        return self.count


def count_values(raw: bytes, limit: int | None, checkpoint: Callable[[], None] | None = None) -> int:
    """:class:`ValueCounter` over ``raw`` in windows of :data:`SCAN_WINDOW` bytes, stopped as soon as
    the count passes ``limit``."""
    if limit is not None and len(raw) <= limit:
        return 1                                         # every counted byte is a byte: it fits
    counter, view = ValueCounter(), memoryview(raw)
    for start in range(0, len(raw), SCAN_WINDOW):
        if checkpoint is not None:
            checkpoint()
        if counter.feed(view[start:start + SCAN_WINDOW]) > (limit if limit is not None else float("inf")):
            break
    return counter.count


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:32]} is out of range")
    return value


def _bounded_int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"an integer has {digits} digits; at most {MAX_INT_DIGITS} are allowed")
    return int(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """An object's members as a dict, refused (422) when a key repeats: readers disagree on which of
    two values counts (first or last), so a proxy and this server could act on different requests."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise RequestError(f"duplicate key {json.dumps(key)[:120]} in a JSON object: each key may appear "
                                   "once", kind=Kind.INVALID)
            seen.add(key)
    return obj


def utf8_text(raw: bytes) -> str:
    """The body as text: UTF-8 only (RFC 8259), without a byte order mark; raises RequestError (MALFORMED)
    naming the encoding a UTF-16 or UTF-32 body is in."""
    if raw[:3] == b"\xef\xbb\xbf":
        raise RequestError("body is not valid JSON: it starts with a byte order mark (JSON bodies must be UTF-8 "
                           "without one, RFC 8259)", kind=Kind.MALFORMED)
    encoding = json.detect_encoding(raw[:4])
    if encoding != "utf-8":
        raise RequestError(f"body is not valid JSON: it is {encoding.upper()}-encoded (JSON bodies must be UTF-8, "
                           "RFC 8259)", kind=Kind.MALFORMED)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"body is not valid JSON: not valid UTF-8 ({exc.reason} at byte {exc.start})",
                           kind=Kind.MALFORMED) from None


def too_many_values(limits: RequestLimits) -> RequestError:
    return RequestError(f"the body has more than {limits.max_values} JSON values; no request with that many fits in "
                        f"{limits.budget()}", kind=Kind.TOO_COMPLEX)


def decode_json(raw: bytes | str, limits: RequestLimits | None = None,
                checkpoint: Callable[[], None] | None = None, counted: bool = False) -> Any:
    """Strict JSON: UTF-8 bytes (:func:`utf8_text`), no NaN/Infinity, no number overflowing to
    infinity, integers of at most 4,300 digits, no key repeated in an object, within
    ``limits.max_values`` (unless ``counted`` already); raises RequestError (MALFORMED, INVALID for
    a repeated key, or TOO_COMPLEX)."""
    if limits is not None and limits.max_values is not None and not counted:
        data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
        if count_values(data, limits.max_values, checkpoint) > limits.max_values:
            raise too_many_values(limits)
    text = utf8_text(raw) if isinstance(raw, bytes) else raw
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float, parse_int=_bounded_int,
                          object_pairs_hook=_unique_keys)
    except RequestError:
        raise
    except ValueError as exc:
        raise RequestError(f"body is not valid JSON: {exc}", kind=Kind.MALFORMED) from None
    except RecursionError:
        raise RequestError("body is not valid JSON: nested too deeply", kind=Kind.MALFORMED) from None
