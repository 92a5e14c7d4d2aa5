"""``POST /v1/systemone/bulk``: NDJSON in (one SystemOne request per line), NDJSON out.

Each output line is ``{"index": i, "status": s, "body": ...}``, written as soon as record ``i``
(0-based line number of the input; blank lines are skipped but counted) is answered, so lines come
out of order. ``body`` is exactly what ``POST /v1/systemone`` would have returned for that line,
error bodies included; a bad line never affects the others. The last line is
``{"summary": {"records", "ok", "failed", "aborted"}}``.

Backpressure: the body is read incrementally and at most ``bulk_concurrency`` records of a stream
are in progress; the next line is read only when one finishes, so a fast sender is slowed down
by TCP flow control. Finished lines wait in a bounded buffer while the client is not reading.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from clef_vllm.protocol import RequestError
from clef_vllm.server.admission import BULK
from clef_vllm.server.body import decode_json
from clef_vllm.server.context import RequestContext, ServerError, reason_of
from clef_vllm.server.logs import LOG_CONTEXT
from clef_vllm.server.service import DecisionService, wait_for_disconnect

log = logging.getLogger("clef_vllm.server")

#: Finished lines held while the client is not reading (a few MB); then records stop finishing.
OUTPUT_BUFFER_LINES = 10_000
TOO_LONG = object()


class ClientGone(Exception):
    pass


def ndjson_line(obj: dict) -> bytes:
    """One output line. ASCII-only JSON: U+2028, U+0085 and friends stay escaped, so a consumer that
    splits on any Unicode line break (Python's ``str.splitlines``) still sees one record per line."""
    return json.dumps(obj, separators=(",", ":")).encode("ascii") + b"\n"


async def read_lines(receive: Receive, max_line_bytes: int) -> AsyncIterator[tuple[int, object]]:
    """``(line index, bytes)`` for each line of the body as it arrives; ``TOO_LONG`` in place of a
    line over ``max_line_bytes`` (the rest of it is skipped). Raises ClientGone on disconnect."""
    buf = bytearray()
    index, skipping = 0, False
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        data = message.get("body", b"")
        start = 0
        while (newline := data.find(b"\n", start)) >= 0:
            if skipping:
                skipping = False
            else:
                buf += data[start:newline]
                yield index, (bytes(buf) if len(buf) <= max_line_bytes else TOO_LONG)
            buf.clear()
            index += 1
            start = newline + 1
        if not skipping:
            buf += data[start:]
            if len(buf) > max_line_bytes:
                yield index, TOO_LONG
                buf.clear()
                skipping = True
        if not message.get("more_body", False):
            if buf and not skipping:
                yield index, bytes(buf)
            return


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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        service = self.service
        service.bulk_streams += 1
        try:
            with service.track():
                # Read before answering: a client sending "Expect: 100-continue" gets its 100 now
                # (uvicorn sends none once the response has started).
                first, replayed = await receive(), False

                async def receive_from_first() -> dict:
                    nonlocal replayed
                    if not replayed:
                        replayed = True
                        return first
                    return await receive()

                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                out: asyncio.Queue = asyncio.Queue(maxsize=OUTPUT_BUFFER_LINES)
                reader = asyncio.create_task(self._read_and_run(receive_from_first, out))
                try:
                    while (line := await out.get()) is not None:
                        await send({"type": "http.response.body", "body": line, "more_body": True})
                finally:
                    reader.cancel()
                    await asyncio.gather(reader, return_exceptions=True)
                if not reader.cancelled() and reader.exception() is not None:
                    log.error("bulk stream failed: %s", reader.exception(), exc_info=reader.exception())
                    self.aborted = self.aborted or "internal error"
                summary = dict(self.counts, aborted=self.aborted)
                await send({"type": "http.response.body", "body": ndjson_line({"summary": summary}),
                            "more_body": False})
                log.info("bulk stream done", extra=summary)
        finally:
            service.bulk_streams -= 1

    async def _read_and_run(self, receive: Receive, out: asyncio.Queue) -> None:
        service, settings = self.service, self.service.settings
        slots = asyncio.Semaphore(settings.bulk_concurrency)
        tasks: set[asyncio.Task] = set()
        lines = read_lines(receive, settings.max_body_bytes)
        stop = asyncio.ensure_future(service.stopping.wait())   # drain or engine failure: stop reading
        try:
            while True:
                nxt = asyncio.ensure_future(anext(lines))
                await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    await asyncio.gather(nxt, return_exceptions=True)
                    self.aborted = "server is shutting down" if service.status == "draining" else "engine failed"
                    break
                try:
                    index, line = nxt.result()
                except StopAsyncIteration:
                    break
                if line is not TOO_LONG and not line.strip():
                    continue
                await slots.acquire()
                service.bulk_records_in_progress += 1
                task = asyncio.create_task(self._record(index, line, out, slots))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            # body done (or aborted): let the records finish, unless the client leaves meanwhile
            if tasks:
                finished = asyncio.ensure_future(asyncio.gather(*tasks))
                gone = asyncio.ensure_future(wait_for_disconnect(receive)) if self.aborted is None else None
                await asyncio.wait({finished} | ({gone} if gone else set()), return_when=asyncio.FIRST_COMPLETED)
                if gone is not None:
                    gone.cancel()
                if not finished.done():
                    raise ClientGone()
        except ClientGone:
            self.aborted = "client disconnected"
            log.info("bulk client disconnected; cancelling %d record(s)", len(tasks))
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            stop.cancel()
            try:
                await lines.aclose()
            except RuntimeError:            # cancelled while the generator was suspended in receive()
                pass
            await out.put(None)

    async def _record(self, index: int, line, out: asyncio.Queue, slots: asyncio.Semaphore) -> None:
        service = self.service
        ctx = RequestContext(self.ctx.request_id, "bulk", record=index, timeout_s=self.ctx.timeout_s)
        LOG_CONTEXT.set({"request_id": ctx.request_id, "record": index})
        try:
            try:
                if line is TOO_LONG:
                    raise ServerError(f"line exceeds {service.settings.max_body_bytes} bytes (--max-body-bytes)",
                                      status=413, reason="body_too_large")
                status, body = 200, await service.answer(decode_json(line), ctx, BULK)
            except RequestError as exc:
                status, body = exc.status, exc.body(service.dialect)
                ctx.reason = reason_of(exc)
            except Exception as exc:  # noqa: BLE001 - one record's failure never ends the stream
                log.error("bulk record failed: %s", exc, exc_info=exc)
                status, ctx.reason = 500, "internal"
                body = RequestError("internal server error", status=500).body(service.dialect)
            self.counts["records"] += 1
            self.counts["ok" if status == 200 else "failed"] += 1
            service.metrics.bulk_records.labels(str(status), ctx.reason).inc()
            service.metrics.stage_seconds.labels("total", BULK).observe(ctx.elapsed())
            await out.put(ndjson_line({"index": index, "status": status, "body": body}))
        finally:
            service.bulk_records_in_progress -= 1
            slots.release()
