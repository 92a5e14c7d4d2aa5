"""The backend interface the server and the offline API talk to (never to vLLM directly)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from abc import ABC, abstractmethod
from typing import Sequence

import torch

from clef_vllm.encoding import EncodedRequest, RequestEncoder

log = logging.getLogger("clef_vllm")

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` / ``"float32"`` (the head's compute dtype) -> torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


class Backend(ABC):
    """Runs the backbone and the joint head on encoded requests.

    ``decide_batch`` is the synchronous path (offline API); ``decide`` the asyncio path (server).
    Both return, per request, the fp32 per-option probabilities in encoded option order.
    """

    name: str = "backend"
    encoder: RequestEncoder
    max_model_len: int

    @abstractmethod
    def decide_batch(self, encoded: Sequence[EncodedRequest]) -> list[torch.Tensor]:
        """Probabilities for many requests at once (blocking)."""

    async def decide(self, encoded: EncodedRequest) -> torch.Tensor:
        """Probabilities for one request (non-blocking)."""
        return (await asyncio.to_thread(self.decide_batch, [encoded]))[0]

    async def start(self) -> None:
        """Called once inside the server's event loop before serving (engines, warm-up)."""

    def describe(self) -> dict:
        """What runs where, for startup logs and ``/v1/models``."""
        return {"backend": self.name}

    def close(self) -> None:
        """Release engines and threads."""


class MicroBatcher:
    """Collects concurrent ``decide`` calls into batches for a blocking ``decide_batch``.

    One worker thread owns the model; callers await futures. A batch is whatever is queued
    when the worker becomes free (up to ``max_batch_size`` requests / ``max_batch_tokens``).
    """

    def __init__(self, run_batch, max_batch_size: int = 32, max_batch_tokens: int = 65536):
        self._run = run_batch
        self._max_size = max_batch_size
        self._max_tokens = max_batch_tokens
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="clef-reference-batcher", daemon=True)
        self._thread.start()

    async def submit(self, encoded: EncodedRequest) -> torch.Tensor:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.put((encoded, fut, loop))
        return await fut

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch, tokens = [item], item[0].num_tokens
            while len(batch) < self._max_size:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                if tokens + nxt[0].num_tokens > self._max_tokens:
                    self._queue.put(nxt)  # next batch; order among queued requests is not promised
                    break
                batch.append(nxt)
                tokens += nxt[0].num_tokens
            live = [b for b in batch if not b[1].cancelled()]
            if not live:
                continue
            try:
                results = self._run([b[0] for b in live])
                for (_, fut, loop), res in zip(live, results):
                    loop.call_soon_threadsafe(_resolve, fut, res, None)
            except BaseException as exc:  # noqa: BLE001 - hand every failure back to its caller
                log.exception("batch of %d requests failed", len(live))
                for _, fut, loop in live:
                    loop.call_soon_threadsafe(_resolve, fut, None, exc)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)


def _resolve(fut: asyncio.Future, result, exc) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
