"""Testing hooks, off unless their environment variables are set. Never used in production.

* ``CLEF_VLLM_LOAD_GATE=PATH``: model loading waits (at most 10 minutes) until PATH exists, so the
  "loading" state (``/health`` 503) can be observed deterministically.
* ``CLEF_VLLM_FAULTS=key[=value],...`` wraps the loaded backend in :class:`FaultyBackend`:

  - ``hold_dir=DIR``: a decision whose question ids include ``hold.NAME`` stays in the engine
    until ``DIR/NAME`` exists (deterministic in-flight, queue-full, timeout and drain states);
  - ``engine_pid_file=PATH``: start a stand-in "engine process" (a child forked from the loading
    thread, as vLLM forks its engine cores, that idles) and write its pid to PATH. Killing it
    makes the backend dead, as when vLLM's engine core dies: health checks and decisions raise
    :class:`BackendDeadError`. Killed while the load is held by ``CLEF_VLLM_LOAD_GATE``, it makes
    the load fail, as vLLM's start-up handshake does;
  - ``load_fail``: the load raises after the gate (a model that never comes up);
  - ``instant``: decisions are answered at once with uniform probabilities, without the model
    (benchmarks of everything but the engine: HTTP, limits, decoding, encoding, answers; with
    ``--no-warmup`` the checkpoint's tokenizer may even be larger than its tiny model's vocabulary).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import time
from pathlib import Path
from typing import Callable, Sequence

from clef_vllm.backends.base import Backend, BackendDeadError
from clef_vllm.schema.encoding import EncodedRequest

log = logging.getLogger("clef_vllm.faults")

LOAD_GATE_ENV = "CLEF_VLLM_LOAD_GATE"
FAULTS_ENV = "CLEF_VLLM_FAULTS"
HOLD_PREFIX = "hold."


def parse_faults(text: str | None) -> dict[str, str]:
    """``"a=1,b"`` -> ``{"a": "1", "b": ""}``."""
    out = {}
    for item in (text or "").split(","):
        if item.strip():
            key, _, value = item.strip().partition("=")
            out[key] = value
    return out


#: A stand-in engine whose server is gone exits after this many seconds (a test run killed outright
#: leaves nothing behind for long); a server that stops its children does so within seconds.
ORPHAN_EXIT_S = 30.0


def _idle_like_an_engine(parent: int) -> None:
    """The stand-in's life: Python idling with the signal handlers a fork leaves it, like vLLM's
    engine core while it starts (vLLM installs its own handlers only once the engine is up)."""
    orphaned = None
    while True:
        time.sleep(0.2)
        if os.getppid() != parent:
            orphaned = orphaned or time.monotonic()
            if time.monotonic() - orphaned > ORPHAN_EXIT_S:
                os._exit(0)


class EngineStandIn:
    """A child process playing the engine: the backend is dead once it exits. Forked through
    ``multiprocessing`` from the loading thread, as vLLM starts its engine cores."""

    def __init__(self, pid_file: str):
        self.proc = multiprocessing.get_context("fork").Process(
            target=_idle_like_an_engine, args=(os.getpid(),), name="EngineCoreStandIn", daemon=False)
        self.proc.start()
        Path(pid_file).write_text(str(self.proc.pid))
        log.info("fault hook: stand-in engine process pid %d", self.proc.pid)

    def check(self) -> None:
        code = self.proc.exitcode
        if code is not None:
            raise BackendDeadError(f"engine process {self.proc.pid} exited with code {code}")

    def stop(self) -> None:
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()


def wrap_load(load: Callable[[], Backend], environ=os.environ) -> Callable[[], Backend]:
    """The CLI's loader with the hooks of the environment applied (unchanged when none is set)."""
    gate = environ.get(LOAD_GATE_ENV)
    faults = parse_faults(environ.get(FAULTS_ENV))
    if not gate and not faults:
        return load

    def hooked() -> Backend:
        engine = EngineStandIn(faults["engine_pid_file"]) if "engine_pid_file" in faults else None
        try:
            if gate:
                log.info("%s is set: loading waits for %s", LOAD_GATE_ENV, gate)
                deadline = time.monotonic() + 600
                while not Path(gate).exists() and time.monotonic() < deadline:
                    if engine is not None:
                        engine.check()       # a dead engine fails the load instead of hanging it
                    time.sleep(0.05)
            if "load_fail" in faults:
                raise RuntimeError("fault hook: the engine failed while loading")
            backend = load()
            if engine is not None:
                engine.check()
        except BaseException:
            if engine is not None:
                engine.stop()
            raise
        return FaultyBackend(backend, faults, engine) if faults else backend

    return hooked


class FaultyBackend(Backend):
    """Delegates to a real backend, adding the hooks of ``CLEF_VLLM_FAULTS``."""

    def __init__(self, inner: Backend, faults: dict[str, str], engine: EngineStandIn | None):
        self.inner = inner
        self.name = inner.name
        self.encoder = inner.encoder
        self.max_model_len = inner.max_model_len
        self.hold_dir = Path(faults["hold_dir"]) if faults.get("hold_dir") else None
        self.engine = engine
        self.instant = "instant" in faults

    def decide_batch(self, encoded: Sequence[EncodedRequest]):
        self.check_health()
        if self.instant:
            return [uniform(e) for e in encoded]
        return self.inner.decide_batch(encoded)

    async def decide(self, encoded: EncodedRequest):
        self.check_health()
        holds = [f.question_id[len(HOLD_PREFIX):] for f in encoded.fields if f.question_id.startswith(HOLD_PREFIX)]
        if holds and self.hold_dir is not None:
            try:
                while not all((self.hold_dir / name).exists() for name in holds):
                    self.check_health()
                    await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                log.info("fault hook: held decision %s cancelled", ",".join(holds))
                raise
        if self.instant:
            return uniform(encoded)
        return await self.inner.decide(encoded)

    async def start(self) -> None:
        await self.inner.start()

    def describe(self) -> dict:
        return {**self.inner.describe(), "fault_hooks": True}

    def check_health(self) -> None:
        if self.engine is not None:
            self.engine.check()
        self.inner.check_health()

    def suggested_max_in_flight(self) -> int:
        return self.inner.suggested_max_in_flight()

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            if self.engine is not None:
                self.engine.stop()


def uniform(encoded: EncodedRequest):
    """Uniform probabilities over each field's options (the ``instant`` hook's answer)."""
    import torch

    return torch.cat([torch.full((len(f.option_spans),), 1.0 / len(f.option_spans)) for f in encoded.fields])
