"""clef-bench against a real ``clef-systemone`` on the tiny checkpoint (small runs, CPU): its points, errors,
token-count checks, output files and helpers (``clef_vllm.bench.bench_cli``, ``loadgen``, ``report``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from clef_vllm.bench.bench_cli import main as bench_main
from clef_vllm.bench.bench_cli import parse_concurrency
from clef_vllm.bench.loadgen import (percentile, server_timing, server_total_ms, stage_medians, systemone_url,
                                     unwrap_envelope)
from clef_vllm.bench.parity_cli import main as parity_main
from clef_vllm.testing.server import free_port
from support.bench import GOOD, check_point, flips_are_near_ties, run_bench, write_jsonl


def test_parse_concurrency_and_helpers():
    assert parse_concurrency(["1,4,16"]) == ([1, 4, 16], {})
    assert parse_concurrency(["1,4", "long=1,2", "fanout-64q=1"]) == ([1, 4], {"long": [1, 2], "fanout-64q": [1]})
    assert parse_concurrency(["long=2"]) == ([1, 4, 16, 64], {"long": [2]})
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5 and percentile([], 50) is None
    assert percentile(list(range(101)), 90) == 90
    assert server_total_ms("total;dur=12.5") == 12.5 and server_total_ms("db;dur=3, total;dur=7") == 7.0
    assert server_total_ms(None) is None
    assert server_timing("parse;dur=0.21, encode;dur=1.5, engine;dur=40.25, total;dur=43") == \
        {"parse": 0.21, "encode": 1.5, "engine": 40.25, "total": 43.0}
    assert server_timing(None) == {} and server_timing("garbage") == {}
    assert stage_medians([{"engine": 10.0, "total": 12.0}, {"engine": 30.0, "total": 31.0}, {"total": 5.0}]) == \
        {"engine": 20.0, "total": 12.0}
    from clef_vllm.bench.report import stages_table

    assert stages_table({"points": [{"variant": "short", "concurrency": 1}]}) is None    # no stages: no table
    text = stages_table({"points": [{"variant": "short", "concurrency": 1,
                                     "server_stages_p50_ms": {"total": 33.0, "engine": 29.2, "encode": 0.9}}]})
    assert text.splitlines()[1].split() == ["variant", "c", "encode", "engine", "total"]   # in request order
    assert text.splitlines()[3].split() == ["short", "1", "0.9", "29.2", "33.0"]
    assert systemone_url("http://h:1/") == systemone_url("http://h:1/v1/systemone") == "http://h:1/v1/systemone"
    assert unwrap_envelope({"result": {"answers": {}}, "success": True}) == {"answers": {}}


def test_bench_modules_import_without_torch_or_vllm():
    code = ("import sys, clef_vllm.bench.bench_cli, clef_vllm.bench.parity_cli, clef_vllm.bench.raw_vllm; "
            "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bench_short_and_fanout_against_live_server(live_server, tiny_release, tiny_short_tokens, tmp_path, capsys):
    rc, res = run_bench([live_server.url, "--tokenizer", str(tiny_release), "--workload", "short,fanout",
                      "--short-tokens", str(tiny_short_tokens), "--fanout-tokens", "64", "--fanout-questions", "1,3",
                      "--concurrency", "1,2", "fanout=2", "-n", "4", "--warmup", "1", "--wait-ready", "30",
                      "--label", "ci", "--fail-on-error"], tmp_path / "bench.json")
    assert rc == 0
    assert res["schema"] == "clef-bench/1" and res["mode"] == "http" and res["label"] == "ci"
    assert res["target"]["url"] == live_server.url + "/v1/systemone"
    assert res["server"]["data"][0]["backend"] == "reference"
    assert [(p["variant"], p["concurrency"]) for p in res["points"]] == [
        ("short", 1), ("short", 2), ("fanout-1q", 2), ("fanout-3q", 2)]
    for p in res["points"]:
        check_point(p)
    short = res["points"][0]
    assert short["input_tokens"]["mean_expected"] == tiny_short_tokens
    assert short["input_tokens"]["total_reported"] == 4 * tiny_short_tokens
    assert [v["questions"] for v in res["variants"]] == [3, 1, 3]
    assert res["complete"] is True and res["finished_utc"]
    assert (tmp_path / "bench.txt").read_text().startswith("clef-bench http")
    table = capsys.readouterr().out
    assert "p99 ms" in table and "fanout-3q" in table and "MISMATCH" not in table
    # and where the server's time went, per point (the reference backend reports its micro-batch stages too)
    stages = table[table.index("server time per stage"):].splitlines()
    assert stages[1].split()[:4] == ["variant", "c", "parse", "queue"] and "engine" in stages[1]
    assert len(stages) == 3 + len(res["points"]) and stages[3].split()[:2] == ["short", "1"]
    assert "server time per stage" in (tmp_path / "bench.txt").read_text()


def test_bench_tokenizer_demo_is_the_local_demo_checkpoint(live_server, tiny_short_tokens, tmp_path, capsys):
    """--tokenizer demo means the demo checkpoint (its tokenizer is the tiny one the live server uses);
    a name that is not a folder fails at once, naming the flag, and never reaches for a model hub."""
    from clef_vllm.model.demo import demo_checkpoint

    rc, res = run_bench([live_server.url, "--tokenizer", "demo", "--short-tokens", str(tiny_short_tokens), "-c", "1",
                      "-n", "2", "--warmup", "0", "--fail-on-error"], tmp_path / "demo.json")
    assert rc == 0 and res["points"][0]["input_tokens"]["mismatches"] == 0
    assert res["settings"]["tokenizer"] == str(demo_checkpoint())
    assert f"demo checkpoint (tiny, random weights): {demo_checkpoint()}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        bench_main([live_server.url, "--tokenizer", "no-such-checkpoint", "-o", str(tmp_path / "x.json")])
    assert exit_.value.code == 2
    assert "--tokenizer no-such-checkpoint: no such folder" in capsys.readouterr().err


def test_bench_detects_token_count_mismatch(live_server, tiny_release, tiny_short_tokens, tmp_path):
    # The client believes the server cuts requests at 8 tokens fewer than it does: every count differs.
    rc, res = run_bench([live_server.url, "--tokenizer", str(tiny_release), "--short-tokens", str(tiny_short_tokens),
                      "--max-model-len", str(tiny_short_tokens - 8), "-c", "1", "-n", "3", "--warmup", "0",
                      "--fail-on-error"], tmp_path / "mismatch.json")
    assert rc == 1
    tokens = res["points"][0]["input_tokens"]
    assert tokens["checked"] == 3 and tokens["mismatches"] == 3
    assert tokens["mismatch_examples"][0] == {"request": "short#0", "expected": tiny_short_tokens - 8,
                                              "reported": tiny_short_tokens}


def test_bench_request_file_counts_errors_by_status(live_server, tiny_release, tmp_path):
    path = write_jsonl(tmp_path / "file.jsonl", [
        {**GOOD, "id": "ok-1", "answer": "technical"},
        {**GOOD, "id": "empty-choice", "questions": {"team": {"type": "choice", "criteria": {}}}},
        {**GOOD, "id": "bad-type", "questions": {"q": {"type": "ranking"}}},
        {**GOOD, "id": "ok-2", "state": {"ticket": 1}},
    ])
    rc, res = run_bench([live_server.url, "--tokenizer", str(tiny_release), "--workload", "none", "--requests", str(path),
                      "-c", "2", "--warmup", "0"], tmp_path / "file.json")
    assert rc == 0
    (p,) = res["points"]
    assert p["variant"] == "file" and (p["requests"], p["ok"]) == (4, 2)
    assert p["errors"] == {"422": 2} and p["unexpected_status"] == 0  # the encoder predicted both refusals
    assert p["input_tokens"]["checked"] == 2 and p["input_tokens"]["mismatches"] == 0
    assert {e["request"] for e in p["error_examples"]} == {"empty-choice", "bad-type"}


def test_bench_counts_connection_errors(tiny_release, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # a port nobody listens on
    rc, res = run_bench([url, "--tokenizer", str(tiny_release), "--short-tokens", "600", "-c", "1", "-n", "2",
                      "--warmup", "0", "--timeout", "5", "--fail-on-error"], tmp_path / "dead.json")
    assert rc == 1
    p = res["points"][0]
    assert p["errors"] == {"connect_error": 2} and p["ok"] == 0 and p["latency_ms"] is None


def test_sender_reports_timeouts_and_bad_bodies():
    """The load generator's HTTP client: a server that never answers is a timeout, one that answers
    200 with the wrong number of answers is a bad_response, and neither raises."""
    import asyncio

    from clef_vllm.bench.loadgen import HttpSender
    from clef_vllm.bench.workloads import BenchRequest

    async def scenario():
        async def silent(reader, writer):
            await asyncio.sleep(5)
            writer.close()

        async def wrong(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            body = b'{"answers": {"a": {}}}'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nserver-timing: total;dur=7.5\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            writer.close()

        req = BenchRequest("short", {}, b"{}", 2, None, label="x")
        out = []
        for handler, timeout in ((silent, 0.5), (wrong, 5.0)):
            server = await asyncio.start_server(handler, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            sender = HttpSender(f"http://127.0.0.1:{port}", concurrency=2, timeout=timeout)
            out.append(await sender.send(req))
            await sender.aclose()
            server.close()
        return out

    timed_out, bad = asyncio.run(scenario())
    assert timed_out.status == "timeout"        # the silent server closes only after 5 s: the client gave up first
    assert bad.status == "bad_response" and "1 answers for 2 questions" in bad.error and bad.server_ms == 7.5


def test_point_counts_state_cache_hits():
    """usage.cached_state_tokens is summed per point, as a share of the reported tokens, and shown in the table."""
    from clef_vllm.bench.loadgen import Outcome, summarize_point
    from clef_vllm.bench.report import bench_row
    from clef_vllm.bench.workloads import BenchRequest

    reqs = [BenchRequest("shared-4k", {}, b"{}", 3, 1000, label=f"r{i}") for i in range(4)]
    outs = [Outcome("200", 0.1, input_tokens=1000, cached_tokens=c) for c in (0, 864, 864, None)]
    p = summarize_point("shared-4k", 4, reqs, outs, 1.0)
    assert p["input_tokens"]["cached"] == 1728 and p["input_tokens"]["cached_share"] == 0.432
    assert p["input_tokens"]["requests_with_hits"] == 2
    assert bench_row(p)[-1] == "1000 ok, 43% cached"
    none = summarize_point("short", 1, reqs[:1], outs[:1], 1.0)
    assert none["input_tokens"]["cached"] == 0 and bench_row(none)[-1] == "1000 ok"


def test_bench_compare_mode(tmp_path, capsys):
    def result(mode, tok_s, p50):
        point = {"variant": "short", "concurrency": 4, "input_tok_per_s": tok_s, "req_per_s": tok_s / 300,
                 "latency_ms": {"p50": p50}, "errors": {}}
        return {"mode": mode, "target": {}, "points": [point, {**point, "variant": "long-4k"}]}

    base, res = tmp_path / "raw.json", tmp_path / "server.json"
    base.write_text(json.dumps(result("raw-vllm", 40000.0, 10.0)))
    res.write_text(json.dumps({**result("http", 30000.0, 12.5), "points": result("http", 30000.0, 12.5)["points"][:1]}))
    assert bench_main(["--compare", str(base), str(res), "-o", str(tmp_path / "cmp.json")]) == 0
    (row,) = json.loads((tmp_path / "cmp.json").read_text())["rows"]
    assert row["throughput_ratio"] == 0.75 and row["p50_ratio"] == 1.25
    out = capsys.readouterr().out
    assert "server vs baseline raw vLLM" in out and "0.750" in out


def test_console_scripts_installed():
    """Every console script of pyproject.toml is on PATH next to this interpreter and answers --help."""
    import tomllib

    from conftest import REPO

    scripts = tomllib.loads((REPO / "vllm_plugin" / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"clef-systemone", "clef-bench", "clef-parity", "clef-load", "clef-make-tiny"} <= set(scripts)
    for name in scripts:
        exe = shutil.which(name, path=str(Path(sys.executable).parent))
        assert exe is not None, f"{name} not installed (pip install -e ./vllm_plugin)"
        out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "usage:" in out.stdout, (name, out.stderr[-2000:])
    for name in ("clef-bench", "clef-parity"):
        out = subprocess.run([shutil.which(name, path=str(Path(sys.executable).parent)), "--version"],
                             capture_output=True, text=True, check=True)
        assert out.stdout.startswith("clef-vllm ")


def test_bench_and_parity_against_a_hosted_dialect_server(live_server, workers_ai_server, tiny_release,
                                                         tiny_short_tokens, tmp_path):
    # clef-bench unwraps the {result, success, ...} envelope and still checks the token counts.
    rc, res = run_bench([workers_ai_server.url, "--tokenizer", str(tiny_release), "--short-tokens", str(tiny_short_tokens),
                      "-c", "2", "-n", "4", "--warmup", "0", "--fail-on-error"], tmp_path / "hosted.json")
    assert rc == 0
    check_point(res["points"][0])
    # Two different servers, one model: the same probabilities (confidence formulas differ, and are ignored).
    out = tmp_path / "dialects.json"
    rc = parity_main([live_server.url, workers_ai_server.url, "--synthetic", "8", "--synthetic-max-words", "120",
                      "-c", "1", "--noise-floor", "b",
                      "--noise-concurrency", "3", "-o", str(out), "--no-progress"])
    assert rc == 0
    receipt = json.loads(out.read_text())
    cmp_ = receipt["comparison"]
    assert cmp_["requests_compared"] == 8 and cmp_["problems"] == [] and cmp_["input_token_mismatches"] == 0
    assert cmp_["overall"]["top1_agreement"] == 1.0 and cmp_["overall"]["max_abs_dp"] == 0
    assert list(receipt["noise_floor"]) == ["B"]
    flips_are_near_ties(receipt["noise_floor"]["B"]["comparison"])


def test_clef_bench_measures_with_its_heap_frozen_and_gives_it_back():
    """A full garbage collection over the bench process's ~0.5 M start-up objects pauses every client for ~0.4 s
    (bench/results/cpu_gc_full_collections_*.json): clef-bench freezes them while it measures, and unfreezes them
    after, since tests call its main in their own process."""
    import gc

    from clef_vllm.util.heap import frozen_heap

    assert gc.get_freeze_count() == 0
    with frozen_heap() as frozen:
        assert frozen > 1000 and gc.get_freeze_count() > 1000
        made = [[] for _ in range(10)]                   # allocated after the freeze: not among the frozen
        assert gc.get_freeze_count() <= frozen
    assert gc.get_freeze_count() == 0 and made
