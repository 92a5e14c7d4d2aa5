"""``--engine-core thread`` (clef_vllm.backends.inproc): vLLM's engine stepped by one thread of the server's
process behind AsyncLLM's surface. The engine here is a stand-in with LLMEngine's methods (the real one
needs a GPU: bench/latency.py measures it there); what is tested is the thread, the hand-offs and the
failure paths."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from clef_vllm.backends.inproc import EngineThreadError, ThreadedEngine


class StandInEngine:
    """LLMEngine's add_request / abort_request / has_unfinished_requests / step: a request finishes in its
    ``steps``-th step, giving one output per step; records the threads it was called from."""

    def __init__(self, steps: int = 2, fail_on: str | None = None, fail_step: bool = False):
        self.steps, self.fail_on, self.fail_step = steps, fail_on, fail_step
        self.pending: dict[str, int] = {}
        self.aborted: list[str] = []
        self.threads: set[str] = {threading.current_thread().name}
        self.profiling = None

    def add_request(self, request_id, prompt, params):
        self.threads.add(threading.current_thread().name)
        if request_id == self.fail_on:
            raise ValueError(f"bad request {request_id}")
        self.pending[request_id] = 0

    def abort_request(self, request_ids, internal=False):
        for rid in request_ids:
            self.pending.pop(rid, None)
            self.aborted.append(rid)

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        self.threads.add(threading.current_thread().name)
        time.sleep(0.001)                                  # a step takes a while, as on a GPU
        if self.fail_step:
            raise RuntimeError("CUDA error: an illegal memory access")
        outs = []
        for rid in list(self.pending):
            self.pending[rid] += 1
            finished = self.pending[rid] >= self.steps
            outs.append(SimpleNamespace(request_id=rid, finished=finished, step=self.pending[rid]))
            if finished:
                del self.pending[rid]
        return outs

    def get_supported_tasks(self):
        self.threads.add(threading.current_thread().name)
        return ("embed", "token_embed")

    def start_profile(self):
        self.profiling = threading.current_thread().name

    def stop_profile(self):
        self.profiling = None


def run(coro):
    return asyncio.run(coro)


async def collect(engine, request_id):
    return [(o.request_id, o.step, o.finished) async for o in engine.encode([1, 2, 3], None, request_id=request_id)]


def test_requests_are_stepped_in_the_engine_thread_and_answered_on_the_callers_loop():
    async def main():
        engine = ThreadedEngine(lambda: StandInEngine(steps=2), asyncio.get_running_loop())   # built in its thread
        stand_in = engine.engine
        try:
            a, b = await asyncio.gather(collect(engine, "a"), collect(engine, "b"))
            assert a == [("a", 1, False), ("a", 2, True)] and b == [("b", 1, False), ("b", 2, True)]
            assert await engine.get_supported_tasks() == ("embed", "token_embed")
            await engine.start_profile()
            assert stand_in.profiling == "clef-engine-core"
            await engine.stop_profile()
            # the engine was built, stepped and asked in the engine thread only
            assert stand_in.threads == {"clef-engine-core"} and not engine.errored
        finally:
            engine.shutdown()
        assert engine.errored                               # its thread is gone after shutdown

    run(main())


class StandInLLMEngine(StandInEngine):
    """The stand-in with LLMEngine's parts behind add_request: an input processor (builds the engine request,
    assigns the internal id), an output processor and an engine core that take the built request."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.where: dict[str, list[str]] = {"process_inputs": [], "output_add": [], "core_add": []}
        outer = self

        class InputProcessor:
            def process_inputs(self, request_id, prompt, params, supported_tasks):
                outer.where["process_inputs"].append(threading.current_thread().name)
                assert supported_tasks == ("embed", "token_embed")
                if request_id == outer.fail_on:
                    raise ValueError(f"bad request {request_id}")
                return SimpleNamespace(request_id=request_id, prompt=prompt, external_req_id=None)

            @staticmethod
            def assign_request_id(request):
                request.external_req_id, request.request_id = request.request_id, request.request_id + "-1234abcd"

        class OutputProcessor:
            def add_request(self, request, prompt_text, parent, index):
                outer.where["output_add"].append(threading.current_thread().name)
                assert request.request_id.endswith("-1234abcd") and (prompt_text, parent, index) == (None, None, 0)

        class Core:
            def add_request(self, request):
                outer.where["core_add"].append(threading.current_thread().name)
                outer.pending[request.external_req_id] = 0

        self.input_processor, self.output_processor, self.engine_core = InputProcessor(), OutputProcessor(), Core()

    def add_request(self, request_id, prompt, params):
        self.where.setdefault("add_request", []).append(threading.current_thread().name)
        super().add_request(request_id, prompt, params)


def test_the_engine_request_is_built_in_the_callers_thread_once_the_tasks_are_known():
    """With vLLM's input processor at hand and the supported tasks known, a request's input processing runs
    in the caller's thread (it can overlap a step's wait for the GPU); the engine thread only hands the
    built request to the output processor and the engine core. A prompt vLLM refuses fails in the caller,
    alone; before the tasks are known, the engine thread adds the prompt itself."""
    async def main():
        engine = ThreadedEngine(lambda: StandInLLMEngine(steps=1, fail_on="bad"), asyncio.get_running_loop())
        stand_in = engine.engine
        caller = threading.current_thread().name
        try:
            assert await collect(engine, "early") == [("early", 1, True)]        # tasks not asked yet
            assert stand_in.where["add_request"] == ["clef-engine-core"] and not stand_in.where["process_inputs"]
            await engine.get_supported_tasks()
            got = await asyncio.gather(collect(engine, "a"), collect(engine, "b"))
            assert got == [[("a", 1, True)], [("b", 1, True)]]
            assert stand_in.where["process_inputs"] == [caller, caller]
            assert stand_in.where["output_add"] == stand_in.where["core_add"] == ["clef-engine-core"] * 2
            with pytest.raises(ValueError, match="bad request bad"):
                await collect(engine, "bad")
            assert stand_in.where["core_add"] == ["clef-engine-core"] * 2 and not engine.errored
            assert await collect(engine, "after") == [("after", 1, True)]
        finally:
            engine.shutdown()

    run(main())


def test_a_cancelled_caller_aborts_its_request_and_a_refused_one_gets_its_own_error():
    async def main():
        engine = ThreadedEngine(lambda: StandInEngine(steps=10**9, fail_on="bad"), asyncio.get_running_loop())
        stand_in = engine.engine
        try:
            task = asyncio.create_task(collect(engine, "slow"))
            while "slow" not in stand_in.pending:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            while "slow" not in stand_in.aborted:
                await asyncio.sleep(0.01)
            assert not stand_in.pending
            with pytest.raises(ValueError, match="bad request bad"):
                await collect(engine, "bad")
            stand_in.steps = 1
            assert await collect(engine, "next") == [("next", 1, True)]     # the engine goes on
            assert not engine.errored
        finally:
            engine.shutdown()

    run(main())


def test_an_engine_that_fails_a_step_fails_every_waiting_and_later_request():
    async def main():
        engine = ThreadedEngine(lambda: StandInEngine(steps=10**9), asyncio.get_running_loop())
        stand_in = engine.engine
        try:
            first = asyncio.create_task(collect(engine, "a"))
            second = asyncio.create_task(collect(engine, "b"))
            while len(stand_in.pending) < 2:
                await asyncio.sleep(0.01)
            stand_in.fail_step = True
            for task in (first, second):
                with pytest.raises(EngineThreadError, match="illegal memory access"):
                    await task
            assert engine.errored
            with pytest.raises(EngineThreadError):
                await collect(engine, "c")
            with pytest.raises(EngineThreadError):
                await engine.get_supported_tasks()
        finally:
            engine.shutdown()

    run(main())


def test_an_engine_that_cannot_start_raises_its_own_error():
    def broken():
        raise RuntimeError("not enough GPU memory")

    async def main():
        with pytest.raises(RuntimeError, match="not enough GPU memory"):
            ThreadedEngine(broken, asyncio.get_running_loop())

    run(main())


def test_engine_core_thread_is_a_backend_option_for_one_engine(tiny_release):
    pytest.importorskip("vllm")
    from clef_vllm.backends.options import OptionError, VllmOptions
    from clef_vllm.backends.vllm_backend import engine_kwargs

    assert VllmOptions().engine_core == "process"
    kwargs = engine_kwargs(tiny_release, engine_core="thread")
    assert "engine_core" not in kwargs                     # ours, not an engine argument
    with pytest.raises(OptionError, match="'engine_core' 'thread' runs one engine"):
        engine_kwargs(tiny_release, engine_core="thread", data_parallel_size=2)
    with pytest.raises(OptionError, match="'engine_core' must be one of"):
        engine_kwargs(tiny_release, engine_core="inline")


def test_the_vllm_backend_answers_through_the_engine_thread_and_reports_its_death(tiny_release):
    """VllmBackend over a ThreadedEngine (stand-in engine): an answer comes back through the thread; a step
    that raises is the backend's 'engine core died' for the request and for /health."""
    pytest.importorskip("vllm")
    import torch
    from support import vllm_cpu

    from clef_vllm.backends.base import BackendDeadError
    from clef_vllm.schema.dialects import parse_request
    from clef_vllm.schema.encoding import RequestEncoder

    body = {"model": "clef-flash", "state": {"ticket": "printer on fire"},
            "questions": {"urgent": {"type": "noul", "instructions": "Is it urgent?"}}}
    encoded = RequestEncoder.from_pretrained(tiny_release).encode(parse_request(body))

    class Pooling(StandInEngine):
        def add_request(self, request_id, prompt, params):
            super().add_request(request_id, prompt, params)
            self.prompts = getattr(self, "prompts", {})
            self.prompts[request_id] = list(prompt["prompt_token_ids"])

        def step(self):
            outs = super().step()
            return [SimpleNamespace(request_id=o.request_id, finished=o.finished, num_cached_tokens=0,
                                    prompt_token_ids=self.prompts[o.request_id],
                                    outputs=SimpleNamespace(data=torch.tensor([0.25, 0.75])))
                    for o in outs]

    with vllm_cpu.bare_vllm_backend(max_num_seqs=8, data_parallel_size=1) as backend:
        backend.engine = ThreadedEngine(lambda: Pooling(steps=1), backend._loop)
        # the loop every engine call and AsyncLLM's output handling run on: the server watches its timers too
        assert backend.event_loops() == {"engine": backend._loop} and backend._loop.is_running()
        try:
            [probs] = backend.decide_batch([encoded])
            assert torch.equal(probs, torch.tensor([0.25, 0.75]))
            backend.check_health()
            backend.engine.engine.fail_step = True
            with pytest.raises(BackendDeadError, match="engine core died"):
                backend.decide_batch([encoded])
            with pytest.raises(BackendDeadError, match="engine core died"):
                backend.check_health()
        finally:
            backend.engine.shutdown()
