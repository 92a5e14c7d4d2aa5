"""``POST /v1/systemone/bulk``: NDJSON in (one SystemOne request per line), NDJSON out.

Each output line is ``{"index": i, "status": s, "body": ...}``, written as soon as record ``i``
(0-based line number of the input; blank lines are skipped but counted) is answered, so lines come
out of order. ``body`` is exactly what ``POST /v1/systemone`` would have returned for that line,
error bodies included; a bad line never affects the others. The last line is
``{"summary": {"records", "ok", "failed", "aborted"}}``.

A body has at most ``--max-bulk-lines`` lines, blank ones included: the line past them is answered
413 in the stream (``{"index": N, "status": 413, ...}``), the records in progress finish, the summary
says why the stream ended and the connection closes without reading the rest. Lines are split a
whole piece of the body at a time (:func:`read_lines`), so even a body of blank lines costs little.

Backpressure: the body is read incrementally and at most ``bulk_concurrency`` records of a stream
are in progress; the next line is read only when one finishes, so a fast sender is slowed down
by TCP flow control. Finished lines wait in a bounded buffer while the client is not reading.

A stream counts against ``--max-bulk-streams`` from its first byte of data, not from its headers,
and only while it sends or is being answered: a client that pauses for ``--body-timeout`` with
none of its records in progress, or does not read its answers for as long, loses the stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from clef_vllm.schema.errors import ClefError, ClientClosed, Kind, RequestError, ServiceError
from clef_vllm.server.admission import BULK
from clef_vllm.server.body import BodyReader, body_too_large
from clef_vllm.server.context import RequestContext
from clef_vllm.server.errors import error_body, error_status, outcome
from clef_vllm.util.logs import LOG_CONTEXT
from clef_vllm.server.service import DecisionService

log = logging.getLogger("clef_vllm.server")

#: Finished lines held while the client is not reading (a few MB); then records stop finishing.
OUTPUT_BUFFER_LINES = 10_000
TOO_LONG = object()
TOO_MANY = object()


def ndjson_line(obj: dict) -> bytes:
    """One output line. ASCII-only JSON: U+2028, U+0085 and friends stay escaped, so a consumer that
    splits on any Unicode line break (Python's ``str.splitlines``) still sees one record per line."""
    return json.dumps(obj, separators=(",", ":")).encode("ascii") + b"\n"


async def read_lines(reader: BodyReader, first: dict, max_line_bytes: int,
                     max_lines: int | None = None) -> AsyncIterator[list[tuple[int, object]]]:
    """The body's lines as they arrive, one batch per piece of the body: ``(line index, bytes)`` for
    each complete non-blank line (blank ones are counted, never handed out); ``TOO_LONG`` in place of
    a line over ``max_line_bytes`` (the rest of it is skipped); ``TOO_MANY`` at index ``max_lines``
    once the body has more lines than that, and then nothing more is read. A piece is split in one
    C call and its blank lines cost a few tens of nanoseconds each: no task, no await per line.
    Raises what ``reader`` raises."""
    buf = bytearray()
    index, skipping = 0, False
    message = first
    while True:
        data = message.get("body", b"")
        last = not message.get("more_body", False)
        pieces = data.split(b"\n")
        tail = pieces.pop()                              # after the piece's last newline: not a whole line yet
        batch: list[tuple[int, object]] = []
        if pieces:
            if skipping:                                 # the end of a line already answered TOO_LONG
                skipping = False
            else:
                buf += pieces[0]
                if buf.strip():
                    batch.append((index, bytes(buf) if len(buf) <= max_line_bytes else TOO_LONG))
            buf.clear()
            batch.extend((index + i, line if len(line) <= max_line_bytes else TOO_LONG)
                         for i, line in enumerate(pieces) if i and line.strip())
            index += len(pieces)
        if not skipping:
            buf += tail
            if len(buf) > max_line_bytes:
                batch.append((index, TOO_LONG))
                buf.clear()
                skipping = True
        if last and buf:
            if buf.strip():
                batch.append((index, bytes(buf)))
            buf.clear()
            index += 1
        if max_lines is not None and (index > max_lines or (index == max_lines and (buf or skipping))):
            yield [item for item in batch if item[0] < max_lines] + [(max_lines, TOO_MANY)]
            return
        if batch:
            yield batch
        if last:
            return
        message = await reader.message()


def too_many_lines(limit: int) -> RequestError:
    return RequestError(f"the bulk body has more than {limit} lines (--max-bulk-lines); the rest was not read",
                        kind=Kind.BODY_TOO_LARGE)


class BulkStream(Response):
    """The streaming response; it reads the request body itself while it writes."""

    media_type = "application/x-ndjson"

    def __init__(self, service: DecisionService, ctx: RequestContext):
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
        self.service = service
        self.ctx = ctx
        self.counts = {"records": 0, "ok": 0, "failed": 0}
        self.aborted: str | None = None
        self.in_progress = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        service, settings = self.service, self.service.settings
        reader = service.body_reader(receive)
        reader.min_rate = None                 # a stream's pace is set by its answers, not by a rate
        reader.exempt = lambda: self.in_progress > 0
        with service.track():
            # Wait for data before taking a stream slot (a client sending "Expect: 100-continue" gets
            # its 100 now; uvicorn sends none once the response has started). Errors here are plain
            # HTTP errors: the stream has not started.
            try:
                first = await reader.message()
            except BaseException:
                reader.close()
                raise
            if service.bulk_streams >= settings.max_bulk_streams:
                raise ServiceError(f"{service.bulk_streams} bulk streams are open (--max-bulk-streams)",
                                   kind=Kind.BULK_STREAMS, retry_after=service.admission.retry_after())
            service.bulk_streams += 1
            try:
                await self._stream(scope, reader, first, send)
            finally:
                service.bulk_streams -= 1
                reader.close()

    async def _stream(self, scope: Scope, reader: BodyReader, first: dict, send: Send) -> None:
        timeout = self.service.settings.body_timeout_s
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        out: asyncio.Queue = asyncio.Queue(maxsize=OUTPUT_BUFFER_LINES)
        closed = scope.get("extensions", {}).get("clef.closed") or asyncio.Event()
        runner = asyncio.create_task(self._read_and_run(reader, first, out, closed))
        try:
            while (line := await out.get()) is not None:
                try:
                    await asyncio.wait_for(send({"type": "http.response.body", "body": line, "more_body": True}),
                                           timeout)
                except asyncio.TimeoutError:
                    self.aborted = f"client did not read its answers for {timeout:g} s (--body-timeout)"
                    log.info("bulk client is not reading its answers; closing the connection")
                    close_connection(scope)
                    return
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        if not runner.cancelled() and runner.exception() is not None:
            log.error("bulk stream failed: %s", runner.exception(), exc_info=runner.exception())
            self.aborted = self.aborted or "internal error"
        summary = dict(self.counts, aborted=self.aborted)
        await send({"type": "http.response.body", "body": ndjson_line({"summary": summary}), "more_body": False})
        if not reader.done:                 # the rest of the body is not read: close once the summary is out
            hook = scope.get("extensions", {}).get("clef.close_when_sent")
            if hook is not None:
                hook()
        log.info("bulk stream done", extra=summary)

    async def _read_and_run(self, reader: BodyReader, first: dict, out: asyncio.Queue, closed: asyncio.Event) -> None:
        service, settings = self.service, self.service.settings
        slots = asyncio.Semaphore(settings.bulk_concurrency)
        tasks: set[asyncio.Task] = set()
        lines = read_lines(reader, first, settings.max_body_bytes, settings.max_bulk_lines)
        stop = asyncio.ensure_future(service.stopping.wait())   # drain or engine failure: stop reading
        gone = asyncio.ensure_future(closed.wait())             # the connection closed (clef's protocol)
        try:
            while self.aborted is None:
                nxt = asyncio.ensure_future(anext(lines))
                await asyncio.wait({nxt, stop, gone}, return_when=asyncio.FIRST_COMPLETED)
                if gone.done():
                    nxt.cancel()
                    await asyncio.gather(nxt, return_exceptions=True)
                    raise ClientClosed("client disconnected")
                if not nxt.done():
                    nxt.cancel()
                    await asyncio.gather(nxt, return_exceptions=True)
                    self.aborted = self._stopping_reason()
                    break
                try:
                    batch = nxt.result()
                except StopAsyncIteration:
                    break
                except ClientClosed:
                    raise
                except ClefError as exc:              # too slow, or the server is going away
                    self.aborted = exc.message
                    break
                for index, line in batch:
                    if stop.done():
                        self.aborted = self._stopping_reason()
                        break
                    if slots.locked():
                        slot = asyncio.ensure_future(slots.acquire())
                        await asyncio.wait({slot, gone}, return_when=asyncio.FIRST_COMPLETED)
                        if not slot.done() or gone.done():
                            if slot.done():
                                slots.release()
                            slot.cancel()
                            raise ClientClosed("client disconnected")
                    else:
                        await slots.acquire()         # free: taken without waiting
                    self.in_progress += 1
                    service.bulk_records_in_progress += 1
                    task = asyncio.create_task(self._record(index, line, out, slots, reader))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    if line is TOO_MANY:
                        self.aborted = too_many_lines(settings.max_bulk_lines).message
            # body done (or aborted): let the records finish, unless the client leaves meanwhile
            if tasks:
                finished = asyncio.ensure_future(asyncio.gather(*tasks))
                waits = {finished, asyncio.ensure_future(service.abandon.wait()), gone}
                if self.aborted is None:
                    waits.add(asyncio.ensure_future(wait_for_end(reader)))
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for w in waits - {finished, gone}:
                    w.cancel()
                if not finished.done():
                    if service.abandon.is_set():
                        self.aborted = f"server is shutting down ({service.abandon_cause})"
                        await self._cancel(tasks)
                    else:
                        raise ClientClosed("client disconnected")
        except ClientClosed:
            self.aborted = "client disconnected"
            log.info("bulk client disconnected; cancelling %d record(s)", len(tasks))
            await self._cancel(tasks)
        finally:
            stop.cancel()
            gone.cancel()
            try:
                await lines.aclose()
            except RuntimeError:            # cancelled while the generator was suspended in receive()
                pass
            await out.put(None)

    def _stopping_reason(self) -> str:
        return "server is shutting down" if self.service.status == "draining" else "engine failed"

    @staticmethod
    async def _cancel(tasks: set[asyncio.Task]) -> None:
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _record(self, index: int, line, out: asyncio.Queue, slots: asyncio.Semaphore,
                      reader: BodyReader) -> None:
        service = self.service
        dialect = self.ctx.dialect or service.dialect       # /v1/decisions/bulk: OpenAI's format
        ctx = RequestContext(self.ctx.request_id, "bulk", record=index, timeout_s=self.ctx.timeout_s, dialect=dialect,
                             body_bytes=len(line) if isinstance(line, bytes) else 0)   # a small line's work: on the loop
        LOG_CONTEXT.set({"request_id": ctx.request_id, "record": index})
        try:
            try:
                if line is TOO_LONG:
                    raise body_too_large(service.settings.max_body_bytes, "line")
                if line is TOO_MANY:
                    raise too_many_lines(service.settings.max_bulk_lines)
                status, body = 200, await service.answer(line, ctx, BULK)
            except ClefError as exc:
                status, body = error_status(exc, dialect), error_body(exc, dialect)
                ctx.reason = outcome(exc).reason
            except Exception as exc:  # noqa: BLE001 - one record's failure never ends the stream
                log.error("bulk record failed: %s", exc, exc_info=exc)
                failure = ServiceError("internal server error", kind=Kind.INTERNAL)
                status, ctx.reason, body = 500, "internal", error_body(failure, dialect)
            self.counts["records"] += 1
            self.counts["ok" if status == 200 else "failed"] += 1
            service.metrics.bulk_records.labels(str(status), ctx.reason).inc()
            service.metrics.stage_seconds.labels("total", BULK).observe(ctx.elapsed())
            await out.put(ndjson_line({"index": index, "status": status, "body": body}))
        finally:
            service.bulk_records_in_progress -= 1
            self.in_progress -= 1
            if self.in_progress == 0:
                reader.touch()              # the client has its answers: its pause clock starts now
            slots.release()


async def wait_for_end(reader: BodyReader) -> None:
    """Return when the client disconnects (the body is complete; nothing more is expected)."""
    while True:
        message = await reader.receive()
        if message["type"] == "http.disconnect":
            return


def close_connection(scope: Scope) -> None:
    """Close the client's connection now (clef's uvicorn protocol puts the hook in the scope)."""
    hook = scope.get("extensions", {}).get("clef.close_connection")
    if hook is not None:
        hook()


__all__ = ["BulkStream", "ndjson_line", "read_lines"]
