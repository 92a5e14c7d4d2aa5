"""The real ``clef-systemone`` app (HTTP, validation, encoding, admission, metrics, answers) over a
backend that answers instantly with uniform probabilities: the front-end's own ceiling, and a
check that a load generator is not the bottleneck (CPU only, no model).

    python bench/instant_server.py CKPT PORT          # CKPT: any checkpoint folder (its tokenizer)
    clef-bench http://127.0.0.1:PORT --tokenizer CKPT --workload short --concurrency 1,16,64

With ``--step-ms F --per-token-us P`` the backend answers in *steps*, as vLLM's engine does: the
requests waiting when a step begins (up to ``--step-tokens``) finish together after F ms + P µs per
token, and a request arriving meanwhile waits for the next step (:class:`SteppedEngine`). ``--batch-wait-ms MS`` has it
hold new requests between steps by the scheduler's own rule 5 (``clef_vllm.worker.fast.batch_wait``), polling
every millisecond as vLLM's idle engine core does. Like ``clef-systemone`` it freezes start-up's objects out of the
garbage collector's full collections once loaded (``--no-freeze-heap``: not); ``--gc-log PATH`` records every full
collection's length (with vLLM's client imported, as the real front end has it) and writes them at exit.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
from pathlib import Path
from time import monotonic

import torch
import uvicorn

from clef_vllm.backends.base import Backend
from clef_vllm.backends.options import VllmOptions
from clef_vllm.schema.encoding import RequestEncoder
from clef_vllm.server.app import create_app
from clef_vllm.server.settings import DEFAULT_CPU_INLINE_BYTES, ServerSettings
from clef_vllm.util.heap import FullCollections
from clef_vllm.worker.fast.batch_wait import BatchWait


class InstantBackend(Backend):
    name = "instant"

    def __init__(self, checkpoint: str):
        self.max_model_len = 16384
        self.encoder = RequestEncoder.from_pretrained(checkpoint, max_length=self.max_model_len)

    def decide_batch(self, encoded):
        return [torch.cat([torch.full((len(f.option_spans),), 1.0 / len(f.option_spans)) for f in e.fields])
                for e in encoded]

    async def decide(self, encoded):
        return self.decide_batch([encoded])[0]

    def describe(self) -> dict:
        return {"backend": "instant"}


class SteppedEngine:
    """A stand-in for an engine that batches by step: :meth:`run` returns when the step holding the
    request ends. A step takes every waiting request that fits ``budget`` tokens (at least one) and
    lasts ``fixed_ms + per_token_us × tokens``; requests arriving during a step wait for the next. With a
    ``batch_wait`` (rule 5's decision) an idle engine may hold the waiting requests, looking again every
    millisecond."""

    def __init__(self, fixed_ms: float, per_token_us: float, budget: int = 16384, batch_wait: BatchWait | None = None):
        self.fixed_ms, self.per_token_us, self.budget = fixed_ms, per_token_us, budget
        self.batch_wait = batch_wait or BatchWait(0.0)
        self.steps = 0
        self.requests_per_step: dict[int, int] = {}     # how many steps took how many requests
        self._waiting: list[tuple[int, asyncio.Future, float]] = []     # (tokens, answer, arrival)
        self._stepping: asyncio.Task | None = None

    def step_seconds(self, tokens: int) -> float:
        return (self.fixed_ms + self.per_token_us * tokens / 1000) / 1000

    async def run(self, tokens: int) -> None:
        done = asyncio.get_running_loop().create_future()
        self._waiting.append((tokens, done, monotonic()))
        if self._stepping is None or self._stepping.done():
            self._stepping = asyncio.ensure_future(self._steps())
        await done

    async def _steps(self) -> None:
        while self._waiting:
            if self.batch_wait.hold(monotonic(), running=0, waiting=len(self._waiting), oldest=self._waiting[0][2]):
                await asyncio.sleep(0.001)
                continue
            batch, used = [], 0
            while self._waiting and (not batch or used + self._waiting[0][0] <= self.budget):
                tokens, done, _ = self._waiting.pop(0)
                batch.append(done)
                used += tokens
            self.requests_per_step[len(batch)] = self.requests_per_step.get(len(batch), 0) + 1
            self.batch_wait.stepped(monotonic(), len(batch))
            await asyncio.sleep(self.step_seconds(used))
            self.steps += 1
            for done in batch:
                if not done.done():
                    done.set_result(None)


class SteppedBackend(InstantBackend):
    name = "stepped"

    def __init__(self, checkpoint: str, engine: SteppedEngine):
        super().__init__(checkpoint)
        self.engine = engine

    async def decide(self, encoded):
        await self.engine.run(encoded.num_tokens)
        return self.decide_batch([encoded])[0]

    def suggested_max_in_flight(self) -> int:
        return VllmOptions().max_num_seqs          # as the vLLM backend's (one engine): vLLM's max_num_seqs

    def describe(self) -> dict:
        return {"backend": "stepped", "fixed_ms": self.engine.fixed_ms, "per_token_us": self.engine.per_token_us,
                "step_tokens": self.engine.budget, "steps": self.engine.steps,
                "batch_wait_ms": self.engine.batch_wait.wait_s * 1000,
                "held_steps": self.engine.batch_wait.held_steps,
                "requests_per_step": dict(sorted(self.engine.requests_per_step.items()))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("port", type=int)
    ap.add_argument("--step-ms", type=float, default=None, help="answer in steps of this fixed cost (ms) ...")
    ap.add_argument("--per-token-us", type=float, default=0.0, help="... plus this much per token (µs)")
    ap.add_argument("--step-tokens", type=int, default=16384, help="tokens a step takes at most [16384]")
    ap.add_argument("--batch-wait-ms", type=float, default=0.0, help="hold new requests between steps up to MS [0]")
    ap.add_argument("--cpu-inline-bytes", type=int, default=DEFAULT_CPU_INLINE_BYTES,
                    help=f"the server's --cpu-inline-bytes [{DEFAULT_CPU_INLINE_BYTES}]")
    ap.add_argument("--no-freeze-heap", dest="freeze_heap", action="store_false",
                    help="leave start-up's objects in the garbage collector's full collections (clef-systemone "
                         "freezes them once loaded)")
    ap.add_argument("--gc-log", default=None, metavar="PATH",
                    help="write each full garbage collection's time and milliseconds here (JSON) at exit")
    a = ap.parse_args(argv)
    if a.gc_log:
        import vllm.v1.engine.async_llm  # noqa: F401  # the real front end holds vLLM's client: so does this heap
    pauses = FullCollections(keep_each=True).install() if a.gc_log else None
    if a.step_ms is None:
        make = lambda: InstantBackend(a.checkpoint)  # noqa: E731
    else:
        make = lambda: SteppedBackend(a.checkpoint, SteppedEngine(  # noqa: E731
            a.step_ms, a.per_token_us, a.step_tokens, BatchWait(a.batch_wait_ms / 1000.0)))
    uvicorn.run(create_app(make, ServerSettings(cpu_inline_bytes=a.cpu_inline_bytes, freeze_heap=a.freeze_heap)),
                host="127.0.0.1", port=a.port, log_level="warning")
    if pauses is not None:
        Path(a.gc_log).write_text(json.dumps({"freeze_heap": a.freeze_heap, "frozen_objects": gc.get_freeze_count(),
                                              "full_collections": pauses.each}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
