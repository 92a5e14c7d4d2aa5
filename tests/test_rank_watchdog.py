"""The head's liveness probes of its remote data-parallel ranks (clef_vllm/backends/rank_watchdog.py;
docs/deploy.md, "A remote engine that dies").

No vLLM engine reaches ready on this CPU-only machine (the installed vLLM is the CUDA build: its worker
refuses the CPU device, and the model's GDN and attention kernels are GPU kernels), so no real head and
headless pair can serve here. The probes run against stand-ins of vLLM's engine-core client: in-process
engine cores that answer utility calls between steps, and, end to end, the real server and
``VllmBackend`` whose ``AsyncLLM`` is a stand-in with its remote ranks in a separate process that the test
SIGKILLs."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from clef_vllm.backends.base import BackendDeadError
from clef_vllm.backends.options import OptionError, backend_options, given_options
from clef_vllm.backends.rank_watchdog import (DEADLINE_INTERVALS, DEFAULT_INTERVAL_S, MISSES, PROBE_METHOD,
                                              RankWatchdog, engine_identity, silence_limit_s)
from clef_vllm.server.cli import build_parser
from conftest import REPO, REQUEST, LiveServer
from support.virtual_clock import run_virtual

HEAD = ["-dp", "4", "-dpl", "2", "-dpa", "127.0.0.1"]


def options(argv: list[str]):
    return backend_options("vllm", given_options(build_parser().parse_args(["--backend", "vllm", *argv])))


class EngineCores:
    """vLLM's engine-core client as the watchdog uses it (``core_engines``, ``_call_utility_async(...,
    engine=)``): each rank answers a utility call between two of its steps, as ``EngineCore.run_busy_loop``
    does; a rank in ``silent`` never answers (its process is gone)."""

    def __init__(self, ranks: int = 4):
        self.core_engines = [engine_identity(r) for r in range(ranks)]
        self.silent: set[int] = set()
        self.step_ends: dict[int, float] = {}       # rank -> loop time its current step ends
        self.calls: list[tuple[int, str]] = []

    async def _call_utility_async(self, method: str, *args, engine: bytes):
        rank = int.from_bytes(engine, "little")
        self.calls.append((rank, method))
        if rank in self.silent:
            await asyncio.Future()                   # never answered
        loop = asyncio.get_running_loop()
        while (end := self.step_ends.get(rank, 0.0)) > loop.time():
            await asyncio.sleep(end - loop.time())   # answered when the step in progress ends
        return False


async def run_watchdog(cores: EngineCores, ranks, interval_s: float, deadline_s: float, until: float, stepping=None):
    """Run a watchdog over ``ranks`` until a rank is dead or ``until`` seconds passed; ``stepping``: a
    coroutine run beside it (an engine's steps). Returns the watchdog, the verdicts it gave (each with the
    loop's time it came at) and how long it ran. Run on a virtual clock (:func:`run_virtual`): the seconds are
    the loop's, none is waited for."""
    verdicts = []
    loop = asyncio.get_running_loop()
    dog = RankWatchdog(cores, ranks, lambda rank, why: verdicts.append((rank, why, loop.time())), interval_s,
                       deadline_s)
    dog.start()
    side = asyncio.ensure_future(stepping) if stepping is not None else None
    t0 = loop.time()
    while not verdicts and loop.time() - t0 < until:
        await asyncio.sleep(0.02)
    dog.stop()
    if side is not None:
        side.cancel()
    return dog, verdicts, loop.time() - t0


def test_the_defaults_leave_a_step_far_more_time_than_it_takes():
    assert DEFAULT_INTERVAL_S == 5.0 and MISSES == 3 and DEADLINE_INTERVALS == 2.0
    assert silence_limit_s(DEFAULT_INTERVAL_S) == 30.0
    assert options(HEAD).rank_watchdog_s == 5.0
    assert options([*HEAD, "--rank-watchdog-s", "0"]).rank_watchdog_s == 0.0
    with pytest.raises(OptionError):
        options([*HEAD, "--rank-watchdog-s", "-1"])


def test_a_silent_rank_is_declared_dead_after_its_misses_in_a_row_and_only_it(caplog):
    cores = EngineCores()
    cores.silent.add(3)
    dog, verdicts, _ = run_virtual(run_watchdog(cores, [2, 3], interval_s=0.05, deadline_s=0.2, until=10))
    assert [rank for rank, *_ in verdicts] == [3]
    assert "data-parallel rank 3" in verdicts[0][1] and "3 liveness probes in a row" in verdicts[0][1]
    assert verdicts[0][2] == pytest.approx(MISSES * 0.2)         # its third deadline in a row, not before
    assert dog.dead[0] == 3
    assert {method for _, method in cores.calls} == {PROBE_METHOD}
    assert sum(1 for rank, _ in cores.calls if rank == 3) == MISSES
    # the live rank kept answering meanwhile, probed every interval
    assert sum(1 for rank, _ in cores.calls if rank == 2) >= MISSES * 0.2 / 0.05
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "rank watchdog: data-parallel rank 3 (on another node)" in errors[0]


def test_a_rank_busy_with_long_steps_back_to_back_is_never_declared_dead(caplog):
    """Steps of 1.5 deadlines each, one after another: a probe sent early in a step misses, the next one is
    answered when the step ends, so misses never come MISSES in a row."""
    cores = EngineCores()

    async def steps():
        loop = asyncio.get_running_loop()
        while True:
            cores.step_ends[2] = loop.time() + 0.6
            await asyncio.sleep(0.61)

    dog, verdicts, took = run_virtual(run_watchdog(cores, [2], interval_s=0.1, deadline_s=0.4, until=3.0,
                                                   stepping=steps()))
    assert verdicts == [] and dog.dead is None and took >= 3.0       # five steps' worth of the loop's time
    assert len(cores.calls) >= 4
    misses = [r.getMessage() for r in caplog.records if "did not answer within" in r.getMessage()]
    assert misses and all("(1 of 3)" in m for m in misses)           # probes missed, never two in a row


def test_a_rank_the_client_does_not_hold_is_not_watched_and_a_stopped_watchdog_gives_no_verdict():
    cores = EngineCores(ranks=2)
    cores.silent.add(1)

    async def scenario():
        verdicts = []
        dog = RankWatchdog(cores, [1, 5], lambda *a: verdicts.append(a), 0.05, 0.1)
        dog.start()
        assert len(dog._tasks) == 1                  # rank 5: no such engine in the client
        await asyncio.sleep(0.15)
        dog.stop()
        await asyncio.sleep(0.4)
        return verdicts

    assert run_virtual(scenario()) == []


def test_the_vllm_backend_watches_the_remote_ranks_only_and_is_dead_once_one_is(tiny_release):
    from support import vllm_cpu

    from clef_vllm.schema.dialects import parse_request
    from clef_vllm.schema.encoding import RequestEncoder

    encoded = RequestEncoder.from_pretrained(tiny_release).encode(parse_request(REQUEST))
    cores = EngineCores()
    with vllm_cpu.bare_vllm_backend(data_parallel_size=4) as backend:
        backend.engine = SimpleNamespace(engine_core=cores, errored=False)

        def watch(argv):
            backend.options, backend._watchdog, backend._rank_failure = options(argv), None, None

            async def start():
                backend._watch_remote_ranks()
            backend._submit(start()).result(10)
            return backend._watchdog

        assert watch(["--dp", "4"]) is None                                   # every rank on this node
        assert watch([*HEAD, "--rank-watchdog-s", "0"]) is None               # switched off
        dog = watch([*HEAD, "--rank-watchdog-s", "0.05"])
        assert dog.ranks == [2, 3] and dog.deadline_s == 0.1
        backend.check_health()
        cores.silent.add(3)
        deadline = time.monotonic() + 10
        while backend._rank_failure is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(BackendDeadError, match="data-parallel rank 3"):
            backend.check_health()
        with pytest.raises(BackendDeadError, match="data-parallel rank 3"):
            backend.decide_batch([encoded])
        backend.close()
        assert dog.stopped


#: The head's server with vLLM's AsyncLLM stood in: ranks 0-1 answer here, ranks 2-3 are the process at
#: {rank_port} (UDP on loopback: a datagram to a process that is gone is dropped without a word, as vLLM's
#: ZMQ router drops messages to an engine that vanished). Every request is computed "there".
HEAD_WITH_REMOTE_RANKS = """
import sys
from support import vllm_cpu
vllm_cpu.setup_env()
import asyncio, itertools
from types import SimpleNamespace
import torch
from clef_vllm.contract import PARAMS_KEY, POOLING_TASK
from clef_vllm.model.features import HeadSpec

REMOTE = ("127.0.0.1", {rank_port})


class Replies(asyncio.DatagramProtocol):
    def __init__(self, pending):
        self.pending = pending

    def datagram_received(self, data, addr):
        fut = self.pending.get(int(data))
        if fut is not None and not fut.done():
            fut.set_result(None)


class Client:
    def __init__(self):
        self.core_engines = [r.to_bytes(2, "little") for r in range(4)]
        self.pending, self.ids, self.transport = {{}}, itertools.count(), None

    async def remote(self):
        loop = asyncio.get_running_loop()
        if self.transport is None:
            self.transport, _ = await loop.create_datagram_endpoint(lambda: Replies(self.pending),
                                                                    local_addr=("127.0.0.1", 0))
        n = next(self.ids)
        fut = self.pending[n] = loop.create_future()
        self.transport.sendto(str(n).encode(), REMOTE)
        try:
            await fut
        finally:
            self.pending.pop(n, None)

    async def _call_utility_async(self, method, *args, engine):
        if int.from_bytes(engine, "little") >= 2:
            await self.remote()
        return False


class StandInAsyncLLM:
    errored = False

    def __init__(self):
        self.engine_core = Client()

    async def get_supported_tasks(self):
        return (POOLING_TASK,)

    async def encode(self, prompt, params, request_id):
        await self.engine_core.remote()
        n = HeadSpec.from_wire(params.extra_kwargs[PARAMS_KEY]).num_options
        yield SimpleNamespace(finished=True, prompt_token_ids=prompt["prompt_token_ids"], num_cached_tokens=0,
                              outputs=SimpleNamespace(data=torch.full((n,), 1.0 / n)))

    def shutdown(self):
        pass


from vllm.v1.engine.async_llm import AsyncLLM
AsyncLLM.from_engine_args = classmethod(lambda cls, args, **kwargs: StandInAsyncLLM())
from clef_vllm.server.cli import main
if __name__ == "__main__":
    sys.exit(main(["--backend", "vllm", "--model", {model!r}, "--no-warmup", "--port", sys.argv[1], "-dp", "4",
                   "-dpl", "2", "-dpa", "127.0.0.1", "--rank-watchdog-s", {interval!r}, "--request-timeout", "120"]))
"""

#: The remote ranks' stand-in: answers every datagram with itself.
REMOTE_RANKS = """
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1], flush=True)
while True:
    data, addr = s.recvfrom(64)
    s.sendto(data, addr)
"""


def test_a_head_whose_remote_rank_is_killed_answers_503_says_failed_and_exits_1(tiny_release, cache_dir, tmp_path):
    import os

    import httpx

    remote = subprocess.Popen([sys.executable, "-c", REMOTE_RANKS], stdout=subprocess.PIPE, text=True)
    server = None
    try:
        rank_port = int(remote.stdout.readline())
        script = tmp_path / "head.py"
        script.write_text(HEAD_WITH_REMOTE_RANKS.format(model=str(tiny_release),
                                                        rank_port=rank_port, interval="0.25"))
        pythonpath = os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))
        server = LiveServer([], command=lambda port: [sys.executable, str(script), str(port)],
                            env={"PYTHONPATH": pythonpath}, log_path=tmp_path / "head.log").wait_ready()
        for _ in range(3):
            status, text = server.call("/v1/systemone", REQUEST)
            assert status == 200, text
        assert "rank watchdog: probing data-parallel ranks [2, 3] every 0.25 s" in server.log()
        remote.send_signal(signal.SIGKILL)
        remote.wait(10)
        with ThreadPoolExecutor(2) as pool:              # in flight on the vanished rank when it is declared dead
            in_flight = [pool.submit(httpx.post, server.url + "/v1/systemone", json=REQUEST, timeout=60)
                         for _ in range(2)]
            answers = [f.result() for f in in_flight]
        for resp in answers:   # failed by the watchdog's verdict (503 naming the rank), not the request timeout (504)
            assert resp.status_code == 503, resp.text
            error = resp.json()["error"]
            assert "engine failed" in error["message"] and "data-parallel rank" in error["message"]
        # the server exits once its accepted requests are answered: until then it says failed, then it is gone
        try:
            health = httpx.get(server.url + "/health", timeout=5)
            assert health.status_code == 503 and health.json() == {"status": "failed"}
            assert httpx.get(server.url + "/health/live", timeout=5).status_code == 503
            late = httpx.post(server.url + "/v1/systemone", json=REQUEST, timeout=60)
            assert late.status_code == 503 and "engine failed" in late.json()["error"]["message"]
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            pass                                        # gone already, or going while it read the request
        assert server.proc.wait(timeout=60) == 1
        log = server.log()
        assert len(re.findall(r"rank watchdog: data-parallel rank \d \(on another node\) answered none", log)) == 1
        assert "the engine failed while serving" in log and "Traceback" not in log
    finally:
        if remote.poll() is None:
            remote.kill()
        if server is not None:
            server.kill()
