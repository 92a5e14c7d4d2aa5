"""bench/memory_budget.py on CPU: the server log's memory lines, the row's schema, the README table, the
results file's merging, process-group cleanup, and one row end to end against a real ``clef-systemone``
on the reference backend (no ballast, no NVML: those need a GPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import REPO


def _load():
    spec = importlib.util.spec_from_file_location("memory_budget", REPO / "bench" / "memory_budget.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["memory_budget"] = module
    spec.loader.exec_module(module)
    return module


mb = _load()

#: what the 9B Hybrid's server writes at start on an emulated 16 GB card (vLLM's lines from the engine core,
#: the plugin's ``clef memory`` lines from the worker, colour codes as vLLM's logger writes them to a tty)
SERVER_LOG = "\n".join([
    "INFO 12-06 05:10:01 [__init__.py:239] Automatically detected platform cuda.",
    "(EngineCore pid=4242) INFO 12-06 05:10:40 [gpu_model_runner.py:5515] Model loading took 8.61 GiB memory and "
    "6.204511 seconds",
    "2026-12-06 05:10:41,002 INFO clef_vllm: clef memory plan: weights 8.61 GiB (FP8 layers 3.90, NVFP4 layers 2.31 "
    "as Marlin, int8 tables 1.14, head 0.31), activations 1.02 GiB, graphs 0.60 GiB, KV cache 3.61 GiB (59,000 "
    "tokens, 3.6 sequences of 16,384)",
    "(EngineCore pid=4242) \x1b[1;36mINFO\x1b[0m 12-06 05:11:10 [gpu_worker.py:578] Available KV cache memory: 3.95 GiB",
    "(EngineCore pid=4242) INFO 12-06 05:11:10 [kv_cache_utils.py:1869] GPU KV cache size: 61,344 tokens, Maximum "
    "concurrency for 16,384 tokens per request: 3.74x",
    "(EngineCore pid=4242) 2026-12-06 05:11:11,500 INFO clef_vllm: clef memory budget: vLLM's KV cache 3.95 GiB less "
    "what its profiling does not count (CUDA context 0.52 GiB, step graphs 0.30 GiB, head graphs 0.11 GiB): KV cache "
    "3.54 GiB",
    "(EngineCore pid=4242) 2026-12-06 05:11:30,010 INFO clef_vllm: clef memory budget: PyTorch's allocator capped at "
    "13.50 GiB (the budget 14.33 GiB less 0.57 GiB outside it and 0.25 GiB kept free); it frees cached blocks rather "
    "than grow past it",
    "2026-12-06 05:11:40,120 INFO clef_vllm: clef memory: this process holds 14.02 GiB of the device, its allocator "
    "13.31 GiB (12.80 GiB in use) against vLLM's budget of 14.33 GiB (--gpu-memory-utilization 0.18093 of 79.2 GiB); "
    "taken after vLLM sized its KV cache: head graphs 0.12 GiB (1x)",
    "INFO:     Uvicorn running on http://127.0.0.1:8000 (Press CTRL+C to quit)",
]) + "\n"


def test_the_server_log_gives_the_rows_memory_figures():
    got = mb.parse_server_log(SERVER_LOG)
    assert got["model_loading_gib"] == 8.61
    assert got["available_kv_gib"] == 3.95
    assert got["kv_cache_gib"] == 3.54 and got["kv_source"] == "clef memory budget"   # the plugin's final size
    assert got["plan_kv_cache_gib"] == 3.61
    assert got["kv_tokens"] == 61344 and got["max_concurrency_16k"] == 3.74
    assert got["oom"] is False
    lines = got["log_lines"]
    assert len(lines) == 7 and all("\x1b" not in ln for ln in lines)
    assert lines[0].endswith("Model loading took 8.61 GiB memory and 6.204511 seconds")
    assert lines[2] == ("(EngineCore pid=4242) INFO 12-06 05:11:10 [gpu_worker.py:578] Available KV cache memory: "
                        "3.95 GiB")                                                    # verbatim, colours removed
    assert sum("clef memory" in ln for ln in lines) == 4


def test_without_the_plugins_lines_vllms_last_figure_counts_and_a_failed_start_is_read():
    text = ("(EngineCore pid=7) INFO 12-06 05:10:40 [gpu_model_runner.py:5515] Model loading took 12.85 GiB memory "
            "and 7.0 seconds\n"
            "(EngineCore pid=7) INFO [gpu_worker.py:578] Available KV cache memory: 1.20 GiB\n"
            "(EngineCore pid=7) INFO [gpu_worker.py:578] Available KV cache memory: -2.04 GiB\n"
            "(EngineCore pid=7) ERROR Traceback (most recent call last):\n"
            "(EngineCore pid=7) ValueError: No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine.\n")
    got = mb.parse_server_log(text)
    assert got["kv_cache_gib"] == -2.04 and got["kv_source"] == "vLLM Available KV cache memory"
    assert got["plan_kv_cache_gib"] is None and got["kv_tokens"] is None and got["max_concurrency_16k"] is None
    assert got["oom"] is False
    assert mb.failure_reason(text).endswith("when initializing the engine.")
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB"
    assert mb.parse_server_log(text + oom + "\n")["oom"] is True
    # another --max-model-len: sequences of 16,384 from the token count
    other = "INFO GPU KV cache size: 49,152 tokens, Maximum concurrency for 8,192 tokens per request: 6.00x\n"
    assert mb.parse_server_log(other)["max_concurrency_16k"] == 3.0


def test_many_ledger_lines_keep_the_first_and_the_last():
    ledger = [f"2026-12-06 05:12:{i:02d},000 WARNING clef_vllm: clef memory: this process holds {14 + i / 10:.2f} GiB"
              for i in range(60)]
    got = mb.parse_server_log("\n".join([*ledger, "clef memory budget: KV cache 3.50 GiB"]))
    assert len(got["log_lines"]) == mb.MAX_LEDGER_LINES + 1
    assert got["log_lines"][0] == ledger[0] and got["log_lines"][-2] == ledger[-1]
    assert got["kv_cache_gib"] == 3.5


def test_cards_and_the_servers_share():
    assert mb.parse_card("16") == mb.Card("16", 16.0, 15.92)
    assert mb.parse_card("full").full and mb.parse_card("FULL").slug == "full"
    assert mb.parse_card("12=11.6").usable_gib == 11.6 and mb.parse_card("24").slug == "24gb"
    with pytest.raises(ValueError, match="one of 16, 24, 32"):
        mb.parse_card("20")
    args = mb.build_parser().parse_args(["run", "--card", "16", "--ckpt", "/c", "--out", "o.json", "--raw", "--",
                                         "--nvfp4-kernel", "vllm", "--state-cache", "off"])
    assert args.flags == ["--nvfp4-kernel", "vllm", "--state-cache", "off"] and args.raw and args.load_seconds == 120
    args = mb.build_parser().parse_args(["matrix", "--ckpt", "/c", "--out-dir", "d"])
    assert (args.cards, args.raw_at, args.flags, args.load_format) == ("16,24,32,full", "24", [], "clef-dummy")
    share = mb.share_for(15.92, 79.19)
    assert 0.9 * 15.92 - 1e-3 < share * 79.19 <= 0.9 * 15.92              # never above the card's budget
    assert f"{share}" == "0.18093"


def _row(**over):
    row = {k: None for k in mb.ROW_KEYS} | {"flags": "", "started": True, "oom": False, "died": False,
                                            "log_lines": [], "errors": 0, "state_cache_hits": 12,
                                            "gpu": "NVIDIA H100 80GB HBM3", "device_total_gib": 79.19}
    return row | over


def test_the_readme_table_from_rows():
    rows = [_row(card_gib=16, budget_gib=14.33, kv_cache_gib=3.54, kv_tokens=61344, max_concurrency_16k=3.74,
                 peak_process_gib=14.1, short_p50_ms=21.44, short_c16_req_per_s=180.2),
            _row(card_gib=24, budget_gib=21.15, kv_cache_gib=9.9, kv_tokens=171000, max_concurrency_16k=10.4,
                 peak_process_gib=21.3, short_p50_ms=20.9, short_c16_req_per_s=181.0, raw_short_c16_req_per_s=190.5),
            _row(card_gib=32, budget_gib=28.21, started=False, oom=True, raw_note="raw vLLM did not start"),
            _row(card_gib=79.19, budget_gib=71.27, kv_cache_gib=60.1, short_c16_req_per_s=182.0)]
    text = mb.table(rows)
    lines = text.splitlines()
    assert lines[0].startswith("| card | budget | started | KV cache |") and len(lines[1].split("|")) == 12
    assert "| 16 GB (15.92 GiB) | 14.33 GiB | yes | 3.54 GiB | 61,344 | 3.74 | 14.10 / 14.33 GiB | 21.4 ms | " \
           "180.2 req/s | — |" in text
    assert "190.5 req/s (95 %)" in text and "21.30 / 21.15 GiB (over)" in text
    assert "| 32 GB (31.35 GiB) | 28.21 GiB | no, out of memory |" in text and "[1]" in text
    assert "H100 80GB HBM3, full (79.19 GiB)" in text
    assert text.rstrip().endswith("[1] raw vLLM did not start") and "\nKV cache: the plugin's" in text
    assert "flags" not in lines[0]
    assert "`--nvfp4-kernel vllm`" in mb.table([_row(card_gib=16, flags="--nvfp4-kernel vllm")])


def test_results_merge_by_card_and_flags_and_table_reads_the_file(tmp_path, capsys):
    old = [_row(card_gib=16, kv_cache_gib=1.0), _row(card_gib=79.19, kv_cache_gib=50.0)]
    new = [_row(card_gib=16, kv_cache_gib=3.5), _row(card_gib=16, flags="--state-cache off", kv_cache_gib=3.9),
           _row(card_gib=79.19, kv_cache_gib=60.0)]
    merged = mb.merge_rows(old, new)
    assert [(r["card_gib"], r["flags"], r["kv_cache_gib"]) for r in merged] == \
        [(16, "", 3.5), (79.19, "", 60.0), (16, "--state-cache off", 3.9)]
    path = tmp_path / "memory_budget.json"
    mb.write_rows(path, merged)
    assert mb.read_rows(path) == merged and not list(tmp_path.glob("*.tmp"))
    assert mb.main(["table", str(path)]) == 0
    assert sum(ln.startswith("| ") for ln in capsys.readouterr().out.splitlines()) == 4       # the header, 3 rows


def test_stop_group_ends_every_member_of_the_group(tmp_path):
    proc = mb.spawn(["sh", "-c", "sleep 300 & sleep 300 & wait"], tmp_path / "group.log")
    time.sleep(0.1)
    assert mb._group_alive(proc.pid) and proc.pid in mb._LIVE
    mb.stop_group(proc, signal.SIGINT, grace=0.5)      # sh's background children ignore SIGINT: SIGKILL ends them
    assert not mb._group_alive(proc.pid) and proc.pid not in mb._LIVE


def test_a_row_end_to_end_on_the_reference_backend(tiny_release, tmp_path, cache_dir):
    """A real server: started, loaded with the mix (the state cache hits), stopped with its process group;
    then a server that cannot start gives started false and its log's last lines."""
    pools = mb.build_pools(str(tiny_release), short_tokens=360, long_tokens=600, shared_tokens=1030, n_short=4,
                           n_long=2, n_shared=4, image_px=96, n_images=2)
    cfg = mb.RowConfig(card=mb.parse_card("full"), ckpt=str(tiny_release), load_format=None, gpu=False,
                       flags=["--backend", "reference", "--state-cache", "on"], load_seconds=1.0, log_dir=tmp_path,
                       concurrency={"short16": 1, "long": 1, "images": 1, "shared": 1}, warm_short=0, warm_shared=1)
    bad = mb.RowConfig(card=mb.parse_card("full"), ckpt=str(tiny_release), load_format=None, gpu=False,
                       flags=["--backend", "reference", "--dialect", "nonsense"], log_dir=tmp_path, label="bad")
    with ThreadPoolExecutor(2) as pool:                    # the server that cannot start, meanwhile
        failed = pool.submit(mb.run_row, bad, pools)
        row = mb.run_row(cfg, pools)
        failed = failed.result()
    assert list(row) == list(mb.ROW_KEYS)
    assert row["started"] and not row["died"] and not row["oom"], row["log_lines"]
    assert row["errors"] == 0 and row["long_ok"] is True and row["state_cache_hits"] > 0
    assert row["short_p50_ms"] > 0 and row["short_c16_req_per_s"] > 0 and row["load_seconds"] >= 1.0
    assert row["images_ok"] is True and row["image_p50_ms"] > 0        # one 96x96 picture each, through the tower
    assert row["command"] == f"clef-systemone --model {tiny_release} --backend reference --state-cache on"
    assert row["flags"] == "--backend reference --state-cache on" and row["peak_process_gib"] is None
    detail = json.loads((tmp_path / f"{cfg.stem}_load.json").read_text())
    assert [p["variant"] for p in detail["points"]] == ["short c=1", "short c=1", "long c=1", "images c=1",
                                                        "shared-state c=1"]
    assert not mb._group_alive(detail["server_pid"])
    assert (tmp_path / f"{cfg.stem}_server.log.gz").exists() and not (tmp_path / f"{cfg.stem}_server.log").exists()
    json.dumps(row)

    row = failed
    assert not row["started"] and row["died"] and row["short_p50_ms"] is None
    assert any("nonsense" in ln for ln in row["log_lines"])
    assert not mb._group_alive(json.loads((tmp_path / "memory_budget_full_bad_load.json").read_text())["server_pid"])
    assert os.path.exists(tmp_path / "memory_budget_full_bad_server.log.gz") and not mb._LIVE


def test_the_ballast_reports_and_is_stopped_with_its_group(tmp_path):
    """The ballast's protocol with a stand-in child (the real one needs CUDA): its report line is read, stop()
    ends its process group; one that exits without reporting raises with the reason from its log."""
    script = ("import json, os, sys, time; print('ballast: holding 63.27 GiB', file=sys.stderr, flush=True); "
              "print('BALLAST ' + json.dumps({'held': 1, 'free': 2, 'total': 3, 'pid': os.getpid()}), flush=True); "
              "time.sleep(300)")
    ballast = mb.Ballast(15.92, tmp_path / "ballast.log", cmd=[sys.executable, "-c", script])
    info = ballast.start(timeout=30)
    pid = ballast.proc.pid
    assert info["total"] == 3 and info["pid"] == pid and mb._group_alive(pid)
    ballast.stop()
    assert not mb._group_alive(pid) and ballast.proc is None and pid not in mb._LIVE
    assert "holding 63.27 GiB" in (tmp_path / "ballast.log").read_text()

    script = "import sys; print('ballast: only 10.00 GiB free, less than the card', file=sys.stderr); sys.exit(3)"
    failing = mb.Ballast(15.92, tmp_path / "failing.log", cmd=[sys.executable, "-c", script])
    with pytest.raises(RuntimeError, match="only 10.00 GiB free"):
        failing.start(timeout=30)
    assert not mb._LIVE


class _Gpu:
    """A device whose processes and used memory follow a script (NVML's answers)."""

    def __init__(self, steps):
        self.steps, self.i = steps, 0

    def processes(self):
        return self.steps[min(self.i, len(self.steps) - 1)][0]

    def used_bytes(self):
        used = self.steps[min(self.i, len(self.steps) - 1)][1]
        self.i += 1
        return used


def test_the_sampler_counts_only_the_processes_that_came_after_its_start():
    g = int(mb.GIB)
    ballast = (11, 63 * g)
    gpu = _Gpu([([ballast], 64 * g), ([ballast, (20, 9 * g)], 73 * g), ([ballast, (20, 12 * g), (21, 2 * g)], 78 * g),
                ([ballast, (20, 10 * g)], 75 * g)])
    sampler = mb.MemorySampler(gpu, period=3600)
    sampler.start()                                         # the baseline: the ballast (and 64 GiB used)
    for _ in range(3):
        sampler.sample()
    sampler.stop()
    assert sampler.peak_bytes == 14 * g and sampler.method.startswith("NVML usedGpuMemory")
    assert sampler.peak_device == 14 * g
    # no per-process figures (NVML_VALUE_NOT_AVAILABLE): the device's used memory less the baseline
    blind = mb.MemorySampler(_Gpu([([(11, None)], 64 * g), ([(11, None), (20, None)], 77 * g)]), period=3600).start()
    blind.sample()
    blind.stop()
    assert blind.peak_bytes == 13 * g and blind.method.startswith("device used memory")
    assert mb.MemorySampler(None).start().peak_bytes is None
