"""Paired A/B runs: ``clef-bench --versus`` / ``--versus-raw`` (``clef_vllm.bench.paired``) on a virtual clock and
against live servers, and ``bench/paired.sh``."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from clef_vllm.bench.bench_cli import main as bench_main
from clef_vllm.testing.server import free_port
from support.bench import run_bench
from support.virtual_clock import START_UNIX, VirtualClock


def test_paired_summary_compares_p50s_per_block_and_counts_unpaired():
    from clef_vllm.bench.paired import paired_summary

    a = [0.030] * 45 + [None, 0.030]
    b = [0.033] * 20 + [0.027] * 25 + [0.040, None]
    s = paired_summary(a, b, block=20)
    assert s["pairs"] == 45 and s["unpaired"] == 2          # a pair counts only if both servers answered
    assert s["a_p50_ms"] == 30.0 and s["ratio"] == pytest.approx(0.9)
    # 45 pairs in blocks of 20: the 5 left over join the second block; the first block has B slower
    assert s["block_ratios"] == [pytest.approx(1.1), pytest.approx(0.9)] and s["b_slower_blocks"] == 1
    assert paired_summary([None], [0.1])["ratio"] is None
    with pytest.raises(ValueError):
        paired_summary(a, b, block=0)


def test_blocks_alternate_abba_and_compare_throughput_per_pair():
    from clef_vllm.bench.paired import block_side, blocks_summary

    assert [block_side(k) for k in range(8)] == [0, 1, 1, 0, 0, 1, 1, 0]

    def blk(side, rps, p50, sent=10, ok=10, steady=None):
        return {"side": side, "req_per_s": rps, "p50_ms": p50, "sent": sent, "ok": ok, "steady_req_per_s": steady}

    s = blocks_summary([blk("a", 10, 100, steady=10), blk("b", 12, 90, steady=10.5),
                        blk("b", 11, 95, ok=9, steady=9), blk("a", 10, 100, steady=10),
                        blk("a", 10, 100)])     # a lone last block has no partner
    assert s["pair_ratios"] == [1.2, 1.1] and s["ratio"] == pytest.approx(1.15) and s["b_faster_pairs"] == 2
    assert s["a_req_per_s"] == 10 and s["b_req_per_s"] == 11.5 and s["p50_ratio"] == pytest.approx(0.925)
    assert s["steady_pair_ratios"] == [1.05, 0.9] and s["steady_ratio"] == pytest.approx(0.975)
    assert s["unanswered"] == 1
    assert blocks_summary([])["ratio"] is None and blocks_summary([])["steady_ratio"] is None


def test_a_blocks_steady_throughput_is_concurrency_over_mean_latency_after_its_start(monkeypatch):
    """Little's law per block: with c requests in flight, c over their mean latency, counting only the
    requests started after STEADY_FROM of the block (the first ones meet a server that was idle). A
    server whose first requests are slow, then steady at 20 ms, reads 4 / 20 ms = 200 req/s steady,
    whatever its first requests and its drain did to the wall-time throughput. On a virtual clock: every
    number is exact."""
    import asyncio

    from clef_vllm.bench.loadgen import Outcome
    from clef_vllm.bench.paired import STEADY_FROM, blocks_summary, paired_table, run_blocks

    clock = VirtualClock(monkeypatch)

    def sender(first_slow):
        async def send(req):
            t = 0.1 if req < first_slow else 0.02
            await asyncio.sleep(t)
            return Outcome("200", t)
        return send

    blocks, wrapped = clock.run(run_blocks(list(range(200)), 4, sender(4), sender(0), blocks=2, block_s=0.4))
    a, b = blocks
    assert STEADY_FROM * 0.4 < 0.1                 # A's slow first requests start before the steady part
    assert a["steady_req_per_s"] == pytest.approx(200) and b["steady_req_per_s"] == pytest.approx(200)
    # over the wall time the slow start counts: A answers 4 in its first 0.1 s where B answers 20
    assert a["ok"] < b["ok"] and a["req_per_s"] < b["req_per_s"]
    s = blocks_summary(blocks)
    assert s["steady_ratio"] == pytest.approx(1.0) and s["ratio"] == pytest.approx(b["req_per_s"] / a["req_per_s"], rel=1e-3)
    assert s["ratio"] > 1.05
    table = paired_table({"target": {"a": "A", "b": "B"},
                          "variants": [{"variant": "short", "concurrency": 4, "blocks": blocks, "wrapped": wrapped, **s}]})
    assert "steady B/A (pairs)" in table and f"{s['steady_ratio']:.3f} (" in table
    # every answer of a 20 ms server comes back in step with the other three: groups of 4, as the table says
    assert all(blk["answers_per_group"] == 4 for blk in blocks)
    assert b["answer_groups"] == [[4, b["ok"] // 4]] and b["ok"] % 4 == 0
    assert s["answers_per_group"]["b"] == 4 and "answers/group A B" in table
    # each block says when it started and how late the clients' own loop ran its timers (none held here)
    assert a["started_unix"] == START_UNIX and b["started_unix"] == pytest.approx(START_UNIX + a["wall_s"], abs=1e-3)
    assert all(blk["client_loop_stalls"] == [] and blk["client_loop_lag_max_ms"] == 0 for blk in blocks)


def test_a_block_records_when_the_clients_own_loop_was_held(monkeypatch):
    """A client whose loop is held (a synchronous 0.25 s call in one send, 10 ms into the block) shows as a
    stall of its block, at the time it happened: the loop-lag watcher's timer, due 50 ms into the block, runs
    210 ms late at 0.26 s; the other block has none (a virtual clock: the hold is exact)."""
    import asyncio

    from clef_vllm.bench.loadgen import Outcome
    from clef_vllm.bench.paired import blocks_summary, paired_table, run_blocks

    clock = VirtualClock(monkeypatch)
    held = []

    async def holding(req):
        await asyncio.sleep(0.01)
        if not held:
            held.append(req)
            clock.advance(0.25)
        return Outcome("200", 0.01)

    async def free(req):
        await asyncio.sleep(0.01)
        return Outcome("200", 0.01)

    blocks, _ = clock.run(run_blocks(list(range(400)), 2, holding, free, blocks=2, block_s=0.6))
    a, b = blocks
    assert len(a["client_loop_stalls"]) == 1 and b["client_loop_stalls"] == [] and b["client_loop_lag_max_ms"] == 0
    at, ms = a["client_loop_stalls"][0]
    assert at == pytest.approx(0.26) and ms == pytest.approx(210) and a["client_loop_lag_max_ms"] == ms
    table = paired_table({"target": {"a": "A", "b": "B"},
                          "variants": [{"variant": "short", "concurrency": 2, "blocks": blocks, "wrapped": False,
                                        **blocks_summary(blocks)}]})
    assert "(clients' loop held >= 100 ms: A 1, B 0)" in table


def test_pairs_alternate_which_server_goes_first_and_stop_at_the_time_limit(monkeypatch):
    import asyncio

    from clef_vllm.bench.loadgen import Outcome
    from clef_vllm.bench.paired import run_pairs

    clock = VirtualClock(monkeypatch)
    calls = []

    def sender(name, delay=0.0):
        async def send(req):
            calls.append((name, req))
            await asyncio.sleep(delay)
            return Outcome("200", 0.01)
        return send

    a, b = clock.run(run_pairs([0, 1, 2, 3], sender("A"), sender("B")))
    assert calls == [("A", 0), ("B", 0), ("B", 1), ("A", 1), ("A", 2), ("B", 2), ("B", 3), ("A", 3)]
    assert len(a) == len(b) == 4
    calls.clear()   # each pair takes 0.1 s: pairs start at 0 and 0.1 s; at 0.2 s, past the 0.15 s limit, none does
    a, b = clock.run(run_pairs(list(range(20)), sender("A", 0.05), sender("B", 0.05), time_limit=0.15))
    assert len(a) == len(b) == 2 and calls == [("A", 0), ("B", 0), ("B", 1), ("A", 1)]


def test_bench_versus_runs_the_same_requests_on_two_live_servers(live_server, workers_ai_server, tiny_release,
                                                                tiny_short_tokens, tmp_path):
    rc, res = run_bench([live_server.url, "--versus", workers_ai_server.url, "--tokenizer", str(tiny_release),
                      "--short-tokens", str(tiny_short_tokens), "-n", "6", "--warmup", "1", "--fail-on-error",
                      "--label", "a-vs-b"], tmp_path / "paired.json")
    assert rc == 0
    assert res["schema"] == "clef-bench-paired/1" and res["mode"] == "paired" and res["complete"] is True
    assert res["target"] == {"a": live_server.url + "/v1/systemone", "b": workers_ai_server.url + "/v1/systemone"}
    [v] = res["variants"]
    assert v["variant"] == "short" and v["requests"] == v["pairs"] == 6 and v["unpaired"] == 0
    assert v["a"]["statuses"] == {"200": 6} and v["b"]["statuses"] == {"200": 6}
    assert v["ratio"] == pytest.approx(v["b_p50_ms"] / v["a_p50_ms"], rel=1e-3) and len(v["block_ratios"]) == 1
    assert v["a"]["server_stages_p50_ms"]["engine"] > 0
    assert len(v["latency_ms"]["a"]) == len(v["latency_ms"]["b"]) == 6 and None not in v["latency_ms"]["b"]
    table = (tmp_path / "paired.txt").read_text()
    assert table.startswith("clef-bench paired:") and "\nshort " in table and "B/A" in table


def test_bench_versus_above_c1_takes_turns_in_time_blocks(live_server, workers_ai_server, tiny_release,
                                                         tiny_short_tokens, tmp_path, capsys):
    rc, res = run_bench([live_server.url, "--versus", workers_ai_server.url, "--tokenizer", str(tiny_release),
                      "--short-tokens", str(tiny_short_tokens), "-c", "2", "-n", "6", "--blocks", "4",
                      "--block-seconds", "0.4", "--warmup", "1", "--fail-on-error"], tmp_path / "blocks.json")
    assert rc == 0
    [v] = res["variants"]
    assert v["concurrency"] == 2 and [b["side"] for b in v["blocks"]] == ["a", "b", "b", "a"]
    assert all(b["ok"] == b["sent"] > 0 and b["statuses"] == {"200": b["sent"]} for b in v["blocks"])
    assert len(v["pair_ratios"]) == 2 and v["ratio"] == pytest.approx(sorted(v["pair_ratios"])[0] / 2
                                                                      + sorted(v["pair_ratios"])[1] / 2, rel=1e-3)
    assert v["a_req_per_s"] > 0 and v["b_req_per_s"] > 0 and v["unanswered"] == 0
    # 6 requests cannot fill four 0.4 s blocks: the pool wrapped, and the table says so
    assert v["wrapped"] is True and "pool wrapped" in (tmp_path / "blocks.txt").read_text()
    with pytest.raises(SystemExit) as exit_:
        bench_main([live_server.url, "--versus", workers_ai_server.url, "--tokenizer", str(tiny_release), "--blocks", "1"])
    assert exit_.value.code == 2 and "--blocks >= 2" in capsys.readouterr().err


class _StubRawEngine:
    """Stands in for clef_vllm.bench.raw_vllm.RawVllmEngine (vLLM's engine needs a GPU): answers at once and
    records what it was sent, started and closed."""

    made: list["_StubRawEngine"] = []

    def __init__(self, engine_kwargs: dict):
        self.engine_kwargs, self.sent, self.started, self.closed, self.start_s = engine_kwargs, [], False, False, None
        _StubRawEngine.made.append(self)

    async def start(self):
        self.started, self.start_s = True, 0.01

    def describe(self) -> dict:
        return {"engine_kwargs": {"model": self.engine_kwargs["model"]}, "engine_start_s": self.start_s}

    async def send(self, req):
        import asyncio

        from clef_vllm.bench.loadgen import Outcome

        assert self.started and not self.closed
        self.sent.append((req.body, list(req.input_ids)))
        await asyncio.sleep(0.002)
        return Outcome("200", 0.002, input_tokens=len(req.input_ids))

    async def finish_profile(self):
        pass

    def close(self):
        self.closed = True


def test_bench_versus_raw_pairs_a_server_with_raw_vllm_in_this_process(live_server, tiny_release, tiny_short_tokens,
                                                                       tmp_path, monkeypatch, capsys):
    """``--versus-raw MODEL_DIR``: A is the server over HTTP, B raw vLLM's embed pooling of the same token ids in
    this process (started once, closed at the end), paired at c=1 and in time blocks above, with the raw
    options passed to the engine; refused without a URL or beside --versus."""
    from clef_vllm.bench import raw_vllm
    from clef_vllm.schema.encoding import RequestEncoder

    _StubRawEngine.made.clear()
    monkeypatch.setattr(raw_vllm, "RawVllmEngine", _StubRawEngine)
    rc, res = run_bench([live_server.url, "--versus-raw", str(tiny_release), "--short-tokens", str(tiny_short_tokens),
                      "-c", "1,2", "-n", "4", "--blocks", "2", "--block-seconds", "0.3", "--warmup", "1",
                      "--raw-load-format", "dummy", "--gpu-memory-utilization", "0.4", "--fail-on-error"],
                     tmp_path / "raw.json")
    assert rc == 0 and res["mode"] == "paired" and res["complete"] is True
    [engine] = _StubRawEngine.made
    assert engine.started and engine.closed
    assert engine.engine_kwargs["load_format"] == "dummy" and engine.engine_kwargs["gpu_memory_utilization"] == 0.4
    assert res["target"] == {"a": live_server.url + "/v1/systemone", "b": f"raw vLLM embed on {tiny_release}"}
    assert res["server"]["b"]["kind"] == "raw-vllm" and res["server"]["b"]["engine_start_s"] == 0.01
    one, two = res["variants"]
    assert one["concurrency"] == 1 and one["pairs"] == 4 and one["unpaired"] == 0
    assert one["a"]["statuses"] == one["b"]["statuses"] == {"200": 4}
    assert two["concurrency"] == 2 and [b["side"] for b in two["blocks"]] == ["a", "b"]
    assert len(two["pair_ratios"]) == 1 and two["unanswered"] == 0
    # B embedded exactly the token ids the server encodes for those requests (the tokenizer: MODEL_DIR's)
    from clef_vllm.schema.dialects import parse_request

    encoder = RequestEncoder.from_pretrained(str(tiny_release))
    assert len(engine.sent) >= 1 + 4 + 1                   # warm-up, the pairs, at least one block request
    for body, ids in engine.sent:
        assert ids == list(encoder.encode(parse_request(body, limits=encoder.request_limits())).input_ids)
    assert "B = raw vLLM embed on" in (tmp_path / "raw.txt").read_text()
    for argv in (["--versus-raw", str(tiny_release), "--raw-vllm", str(tiny_release)],
                 [live_server.url, "--versus", live_server.url, "--versus-raw", str(tiny_release)]):
        with pytest.raises(SystemExit) as exit_:
            bench_main(argv)
        assert exit_.value.code == 2
    assert "--versus-raw needs a server URL (A) and no --versus" in capsys.readouterr().err


def test_bench_versus_a_dead_server_leaves_every_request_unpaired(live_server, tiny_release, tmp_path, capsys):
    dead = f"http://127.0.0.1:{free_port()}"  # a port nobody listens on
    rc, res = run_bench([live_server.url, "--versus", dead, "--tokenizer", str(tiny_release), "--short-tokens", "600",
                      "-n", "2", "--warmup", "0", "--timeout", "5", "--fail-on-error"], tmp_path / "dead.json")
    assert rc == 1
    [v] = res["variants"]
    assert v["pairs"] == 0 and v["unpaired"] == 2 and v["ratio"] is None
    assert v["b"]["statuses"] == {"connect_error": 2} and v["a"]["statuses"] == {"200": 2}
    assert v["latency_ms"]["b"] == [None, None] and all(x > 0 for x in v["latency_ms"]["a"])
    with pytest.raises(SystemExit) as exit_:
        bench_main(["--raw-vllm", str(tiny_release), "--versus", dead])
    assert exit_.value.code == 2 and "--versus needs a server URL" in capsys.readouterr().err


def _free_port_pair() -> int:
    """A port P with P+1 and P+2 free too (bench/paired.sh numbers its servers PORT0+1, PORT0+2)."""
    for _ in range(50):
        base = free_port()
        if base + 2 < 65536 and all(_port_free(base + k) for k in (1, 2)):
            return base
    pytest.skip("no three consecutive free ports")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_paired_script_refuses_a_plan_whose_engines_cannot_fit_on_the_gpu(tiny_release, tmp_path):
    """Three GPU servers at 0.28 of the GPU and raw vLLM after them (on an H200 such servers hold 48-49 GiB each
    and raw's engine cannot start) are refused before any server starts, naming what they need; two at 0.25 with
    raw fit, and so do reference servers (no GPU)."""
    root = Path(__file__).resolve().parents[1]

    def run(compare, *servers, **extra):
        env = {**os.environ, "OUT": str(tmp_path), "COMPARE": compare, "PORT0": str(_free_port_pair()),
               "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", **extra}
        return subprocess.run(["bash", str(root / "bench/paired.sh"), str(tiny_release), *servers], env=env,
                              capture_output=True, text=True, timeout=60)

    proc = run("a:raw:short:16,64 b:a:short:64", "a=--load-format dummy", "b=--gc-freeze off", "c=")
    assert proc.returncode == 2
    assert ("refused: 3 server(s) at GPU_SHARE 0.28 (each ~0.07 more beyond it) and raw vLLM's engine need 1.330 "
            "of the GPU") in proc.stderr
    assert not list(tmp_path.glob("server_*.log"))            # nothing started
    fits = run("a:raw:short:64", "a=--definitely-not-a-flag", GPU_SHARE="0.25", GPU_EXTRA="0.07")
    assert "refused" not in fits.stderr and fits.returncode != 2  # past the check (this server then fails to start)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_paired_script_keeps_one_result_per_comparison(tiny_release, tiny_short_tokens, tmp_path):
    """bench/paired.sh on two reference servers: the same two servers compared at c=1 and at c=2 leave two
    result files (one per comparison and concurrency, so no run overwrites another's per-pair data); ENV_<NAME>
    reaches that server's environment only (here the loader's gate, already open, which the server logs)."""
    root = Path(__file__).resolve().parents[1]
    gate = tmp_path / "gate"
    gate.touch()
    env = {**os.environ, "OUT": str(tmp_path), "PORT0": str(_free_port_pair()), "ENV_y": f"CLEF_VLLM_LOAD_GATE={gate}",
           "COMPARE": "x:y:short x:y:short:2", "PAIRS": "4", "TIME_LIMIT": "20",
           "SERVER_FLAGS": "--backend reference",
           "BENCH_ARGS": f"--short-tokens {tiny_short_tokens} --blocks 2 --block-seconds 0.3",
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", "PY": sys.executable}
    proc = subprocess.run(["bash", str(root / "bench/paired.sh"), str(tiny_release), "x=", "y="], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    c1 = json.loads((tmp_path / "x_vs_y.json").read_text())
    c2 = json.loads((tmp_path / "x_vs_y_c2.json").read_text())
    assert [v["concurrency"] for v in c1["variants"]] == [1] and c1["variants"][0]["pairs"] == 4
    assert [v["concurrency"] for v in c2["variants"]] == [2] and c2["variants"][0]["unanswered"] == 0
    log = (tmp_path / "paired.log").read_text()
    assert log.count("x vs y: rc 0") == 2 and "c>1, the servers in turns" in log and "c=1, the same requests" in log
    startup = (tmp_path / "startup.txt").read_text()          # each server's start, in one place
    assert startup.count("== x: ready after") == 1 and startup.count("== y: ready after") == 1
    assert "reference backend:" in startup and f"; env CLEF_VLLM_LOAD_GATE={gate})" in startup
    assert "CLEF_VLLM_LOAD_GATE is set" in (tmp_path / "server_y.log").read_text()
    assert "CLEF_VLLM_LOAD_GATE" not in (tmp_path / "server_x.log").read_text()
    for name in ("x", "y"):                                    # each server's /metrics after the comparisons
        metrics = (tmp_path / f"metrics_{name}.txt").read_text()
        assert "clef_requests_total" in metrics and "clef_gc_pause_seconds" in metrics
