"""``clef-bench``: load a SystemOne endpoint (or the raw vLLM backbone) and report speed.

  clef-bench http://127.0.0.1:8000 --tokenizer CKPT --workload short,long --concurrency 1,4,16,64
  clef-bench --raw-vllm CKPT --workload short,long --concurrency 1,4,16,64      # backbone baseline
  clef-bench --compare raw.json server.json                                     # side by side
  clef-bench URL_A --versus URL_B -c 1,16,64                                    # paired, in turns
  clef-bench URL --versus-raw CKPT -c 1,16,64 --gpu-memory-utilization 0.3      # paired with raw vLLM

Requests are generated deterministically (``--seed``) with the checkpoint's tokenizer, so each
one's ``usage.input_tokens`` is known in advance and checked. For every (variant, concurrency)
point: req/s, input tok/s, questions/s, p50/p90/p99 latency and errors by HTTP status. Results go
to a JSON file (``-o``) and a one-screen table on stdout. Details: docs/bench.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from clef_vllm.bench import RESULT_SCHEMA_VERSION
from clef_vllm.bench.bench_plan import LONG_REQUEST_TOKENS, PlanItem, int_list, make_plan, parse_concurrency  # noqa: F401 - API
from clef_vllm.bench.loadgen import (HttpSender, base_url, closed_loop, dumps, parse_headers, summarize_point,
                                     systemone_url, wait_ready)
from clef_vllm.bench.report import bench_row, bench_table, compare_points, compare_table
from clef_vllm.bench.workloads import (DEFAULT_FANOUT_QUESTIONS, DEFAULT_FANOUT_STATE_TOKENS, DEFAULT_LONG_TOKENS,
                                       DEFAULT_SHARED_STATES, DEFAULT_SHORT_TOKENS, WORKLOADS,
                                       RequestFactory)
from clef_vllm.util.heap import frozen_heap
from clef_vllm.version import __version__


def _shared_states(text: str) -> list[tuple[int, ...]]:
    out = []
    for item in text.split(","):
        try:
            values = tuple(int(x) for x in item.lower().split("x"))
        except ValueError:
            values = ()
        if len(values) not in (2, 3) or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected TOKENSxREQUESTS[xSTATES] with positive integers, got {item!r}")
        out.append(values)
    return out


def progress_bar(total: int, desc: str, enabled: bool):
    """A point's progress bar on stderr, cleared when done (``--no-progress``: off)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False, disable=not enabled, file=sys.stderr, dynamic_ncols=True)


#: the sweep's concurrencies when -c is not given (--versus: 1)
DEFAULT_CONCURRENCY = ["1,4,16,64"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clef-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"clef-vllm {__version__}")
    p.add_argument("url", nargs="?", help="server base URL or full /v1/systemone URL")
    mode = p.add_argument_group("modes (instead of URL)")
    mode.add_argument("--raw-vllm", metavar="MODEL_DIR",
                      help="baseline: vLLM embed pooling of the same token ids on MODEL_DIR, in-process (GPU)")
    mode.add_argument("--versus", metavar="URL_B",
                      help="paired A/B: at c=1 every request goes to URL (A) and URL_B (B), one at a time, in "
                           "alternating order (-n pairs per variant, default 200; B's p50 over A's); at c>1 the "
                           "two take turns in time blocks (--blocks, --block-seconds; B's req/s over A's). "
                           "-c defaults to 1 here")
    mode.add_argument("--versus-raw", metavar="MODEL_DIR",
                      help="paired A/B against raw vLLM: the server at URL (A) and vLLM embed pooling of the same "
                           "token ids on MODEL_DIR in this process (B), in turns as --versus does (pairs at c=1, "
                           "time blocks above), so both sample the same minutes of the machine; the raw options "
                           "below apply (leave GPU memory for both: the server's and this engine's "
                           "--gpu-memory-utilization)")
    mode.add_argument("--compare", nargs=2, metavar=("BASELINE.json", "RESULT.json"),
                      help="print RESULT next to BASELINE (e.g. raw-vLLM vs server) and exit; with -o, JSON + .txt")

    w = p.add_argument_group("requests")
    w.add_argument("--tokenizer", "--model-dir", dest="tokenizer", metavar="DIR",
                   help="checkpoint folder whose tokenizer sizes the requests, or 'demo' (the demo checkpoint); "
                        "default with --raw-vllm: MODEL_DIR")
    w.add_argument("--workload", default="short",
                   help=f"comma-separated: {', '.join(WORKLOADS)} or all (default short); "
                        "'none' with --requests runs the file only")
    w.add_argument("--requests", metavar="FILE.jsonl",
                   help="also run these requests (one SystemOne body per line; extra keys are ignored)")
    w.add_argument("--limit", type=int, default=None, help="read at most this many records from --requests")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--model-name", default="clef-flash", help='the "model" field of generated requests')
    w.add_argument("--max-model-len", type=int, default=16384,
                   help="the server's token limit, for the expected counts (default 16384, as clef-systemone)")
    w.add_argument("--short-tokens", type=int, default=DEFAULT_SHORT_TOKENS, help="short: total input tokens")
    w.add_argument("--long-tokens", type=int_list, default=list(DEFAULT_LONG_TOKENS),
                   help="long: total input tokens per variant (default 4096,16384)")
    w.add_argument("--fanout-tokens", type=int, default=DEFAULT_FANOUT_STATE_TOKENS,
                   help="fanout: state tokens (default 4096)")
    w.add_argument("--fanout-questions", type=int_list, default=list(DEFAULT_FANOUT_QUESTIONS),
                   help="fanout: questions per variant (default 1,8,32,64)")
    w.add_argument("--shared-states", type=_shared_states, default=list(DEFAULT_SHARED_STATES),
                   metavar="TOKENSxREQUESTS[xSTATES],...",
                   help="shared-state: per variant the state's tokens, requests per point and (optionally) how "
                        "many states they go round-robin over (default 4096x64,15872x33)")

    s = p.add_argument_group("sweep")
    s.add_argument("--unique-per-point", action="store_true",
                   help="give every (variant, concurrency) point requests of its own, so no state repeats across "
                        "points or variants (measure unique-state traffic against a server with --state-cache on); "
                        "shared-state variants keep their states")
    s.add_argument("-c", "--concurrency", nargs="+", default=DEFAULT_CONCURRENCY, metavar="LIST",
                   help="closed-loop clients per point, e.g. '1,4,16,64'; add NAME=LIST to override per "
                        "workload or variant: --concurrency 1,4,16,64 long=1,4,16 fanout=1,8")
    s.add_argument("-n", "--num-requests", type=int, default=None,
                   help="requests per point (default: 4×c, at least 16; 2×c, at least 8, above "
                        f"{LONG_REQUEST_TOKENS} tokens; a request file: all of it)")
    s.add_argument("--warmup", type=int, default=4, help="unmeasured requests per variant before its points")
    s.add_argument("--blocks", type=int, default=12, help="--versus at c>1: time blocks per point (A B B A ...)")
    s.add_argument("--block-seconds", type=float, default=3.0, metavar="S",
                   help="--versus at c>1: seconds per block before no new request starts")
    s.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="stop starting requests after S seconds in a point (in-flight ones finish)")
    s.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    s.add_argument("--header", action="append", default=[], metavar="'Name: value'",
                   help="extra HTTP header; without an Authorization header, the first key of $CLEF_API_KEY is sent "
                        "as 'Authorization: Bearer KEY'")
    s.add_argument("--wait-ready", type=float, default=0.0, metavar="S",
                   help="first wait up to S seconds for GET /health to say 200")

    o = p.add_argument_group("output")
    o.add_argument("-o", "--output", metavar="FILE.json",
                   help="results file (default clef-bench-<time>.json); the table also goes to FILE.txt")
    o.add_argument("--label", default=None, help="free text stored with the results (e.g. 'tiny bf16 dp1')")
    o.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    o.add_argument("--fail-on-error", action="store_true",
                   help="exit 1 if any request got an unexpected status or a token count mismatch (a point "
                        "with no answer at all, such as every request refused 401, exits 1 without this flag)")

    r = p.add_argument_group("raw-vLLM baseline (vLLM engine names; other settings as the server's vLLM backend)")
    r.add_argument("--raw-arch", default="auto",
                   help="architecture override: auto (stock Qwen3.5 class as declared, else Qwen3_5ForCausalLM), "
                        "none, or a class name")
    r.add_argument("--raw-load-format", default="auto", help="auto (dummy for repacked checkpoints) or dummy, ...")
    r.add_argument("--raw-quantization", default=None, help="e.g. fp8 (online) for a BF16 checkpoint")
    r.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    r.add_argument("--enforce-eager", action="store_true")
    r.add_argument("--max-num-seqs", type=int, default=None, help="default: the server backend's default")
    r.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the server backend's default")
    r.add_argument("--linear-backend", default=None, help="vLLM --linear-backend (e.g. emulation)")
    r.add_argument("--raw-engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any other AsyncEngineArgs field (VALUE as JSON when it parses)")
    return p


# --------------------------------------------------------------------------- running


async def run_plan(plan: list[PlanItem], session: Callable[[int], Any], *, time_limit: float | None,
                   progress: bool, log: Callable[[str], None],
                   on_point: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Warm up and measure every (variant, concurrency) point; ``session(c)`` yields a sender.

    ``on_point(points so far)`` runs after each point (the CLI saves partial results there).
    """
    points: list[dict] = []
    for item in plan:
        if item.warm:
            c = min(len(item.warm), max(item.concurrencies))
            async with session(c) as sender:
                warm, _ = await closed_loop(item.warm, c, sender.send)
            bad = [o for o in warm if o is not None and str(o.status) != "200"]
            if bad:
                log(f"warm-up '{item.name}': {len(bad)}/{len(warm)} not 200 (first: {bad[0].status} {bad[0].error})")
        for c in item.concurrencies:
            reqs = item.point_requests(c)
            bar = progress_bar(len(reqs), f"{item.name} c={c}", progress)
            async with session(c) as sender:
                cpu0 = time.process_time()
                outcomes, wall = await closed_loop(reqs, c, sender.send, time_limit=time_limit, on_done=bar.update)
                cpu = time.process_time() - cpu0
            bar.close()
            point = summarize_point(item.name, c, reqs, outcomes, wall, client_cpu_s=cpu)
            points.append(point)
            log("  ".join(bench_row(point)))
            if on_point is not None:
                on_point(points)
    return points


def http_session_factory(url: str, timeout: float, headers: dict):
    @contextlib.asynccontextmanager
    async def session(c: int) -> AsyncIterator[HttpSender]:
        sender = HttpSender(url, concurrency=c, timeout=timeout, headers=headers)
        try:
            yield sender
        finally:
            await sender.aclose()

    return session


def server_info(url: str, headers: dict) -> dict | None:
    import httpx

    try:
        r = httpx.get(base_url(url) + "/v1/models", timeout=10.0, headers=headers)
        return r.json() if r.status_code == 200 else {"status": r.status_code}
    except Exception as exc:  # noqa: BLE001 - informational only
        return {"error": type(exc).__name__}


def environment() -> dict:
    env: dict[str, Any] = {"host": socket.gethostname(), "python": platform.python_version(),
                           "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            env["gpus"] = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        pass
    return env


def _compare(args) -> int:
    baseline, result = (json.loads(Path(p).read_text()) for p in args.compare)
    rows = compare_points(baseline, result)
    name = {"raw-vllm": "raw vLLM", "http": "server"}
    table = compare_table(rows, name.get(baseline.get("mode"), "baseline"), name.get(result.get("mode"), "result"))
    print(table)
    if args.output:
        doc = {"schema": f"clef-bench-compare/{RESULT_SCHEMA_VERSION}", "baseline": args.compare[0],
               "result": args.compare[1], "baseline_target": baseline.get("target"),
               "result_target": result.get("target"), "rows": rows}
        out = Path(args.output)
        out.write_text(dumps(doc) + "\n")
        out.with_suffix(".txt").write_text(table + "\n")
    return 0 if rows else 1


def _wait_until_ready(urls, seconds: float, headers: dict, log: Callable[[str], None]) -> None:
    """``--wait-ready S``: wait for each server's /health (none when S is 0); a server that is not ready ends
    the run with the reason."""
    if seconds <= 0:
        return
    for url in urls:
        try:
            log(f"waiting for {url}: {wait_ready(url, seconds, headers)}")
        except TimeoutError as exc:
            raise SystemExit(f"clef-bench: {exc}") from None


def _raw_engine(args, model_dir: str):
    """The in-process raw vLLM engine of ``--raw-vllm`` / ``--versus-raw`` (not started), from the raw options."""
    from clef_vllm.bench.raw_vllm import RawVllmEngine, parse_engine_arg, raw_engine_kwargs

    extra = dict(parse_engine_arg(a) for a in args.raw_engine_arg)
    return RawVllmEngine(raw_engine_kwargs(model_dir, arch=args.raw_arch, load_format=args.raw_load_format,
                                           max_model_len=args.max_model_len,
                                           gpu_memory_utilization=args.gpu_memory_utilization,
                                           enforce_eager=args.enforce_eager, max_num_seqs=args.max_num_seqs,
                                           max_num_batched_tokens=args.max_num_batched_tokens,
                                           quantization=args.raw_quantization, linear_backend=args.linear_backend,
                                           extra=extra))


def _embeddable_only(plan: list["PlanItem"]) -> None:
    """Raw vLLM embeds token ids: requests the server would refuse (e.g. 413) have none and are dropped."""
    for item in plan:
        item.pool = [r for r in item.pool if r.input_ids is not None]
        item.warm = [r for r in item.warm if r.input_ids is not None]
        item.counts = {c: min(n, len(item.pool) - item.offsets.get(c, 0)) for c, n in item.counts.items()}


class _HttpSide:
    """One side of a paired run: a server, a fresh HTTP sender per point."""

    def __init__(self, url: str, args, headers: dict):
        self.url, self.args, self.headers = url, args, headers

    def describe(self) -> tuple[str, dict | None]:
        return systemone_url(self.url), server_info(self.url, self.headers)

    @contextlib.asynccontextmanager
    async def sender(self, c: int):
        sender = HttpSender(self.url, concurrency=c, timeout=self.args.timeout, headers=self.headers)
        try:
            yield sender.send
        finally:
            await sender.aclose()


class _RawSide:
    """The raw vLLM side of ``--versus-raw``: one engine in this process for the whole run."""

    def __init__(self, engine, model_dir: str):
        self.engine, self.model_dir = engine, model_dir

    def describe(self) -> tuple[str, dict | None]:
        return f"raw vLLM embed on {self.model_dir}", {"kind": "raw-vllm", "model_dir": self.model_dir,
                                                       **self.engine.describe()}

    @contextlib.asynccontextmanager
    async def sender(self, c: int):
        yield self.engine.send


def _paired(args, factory, headers: dict, results: dict, out: Path, log: Callable[[str], None]) -> int:
    """``--versus`` / ``--versus-raw``: the same requests on two targets, in turns (clef_vllm.bench.paired)."""
    from clef_vllm.bench.paired import blocks_summary, paired_table, run_blocks, run_pairs, summarize_variant

    raw = args.versus_raw is not None
    _wait_until_ready((args.url,) if raw else (args.url, args.versus), args.wait_ready, headers, log)
    if args.blocks < 2 or args.block_seconds <= 0:
        build_parser().error("--versus needs --blocks >= 2 and --block-seconds > 0 (blocks are compared in pairs)")
    if args.concurrency == DEFAULT_CONCURRENCY:
        args.concurrency = ["1"]                  # the sweep's default is not the paired run's
    default_c, overrides = parse_concurrency(args.concurrency)
    top = max([*default_c, *(c for cs in overrides.values() for c in cs)])
    # c > 1 takes fresh requests for every block: enough for ~3 s blocks at ~16 requests/s per client
    args.num_requests = args.num_requests or (200 if top == 1 else max(200, 48 * top))
    plan = make_plan(args, factory, log)
    if raw:
        _embeddable_only(plan)
    engine = _raw_engine(args, args.versus_raw) if raw else None
    sides = (_HttpSide(args.url, args, headers),
             _RawSide(engine, args.versus_raw) if raw else _HttpSide(args.versus, args, headers))
    results["schema"] = f"clef-bench-paired/{RESULT_SCHEMA_VERSION}"

    def describe_sides() -> None:
        (a, a_info), (b, b_info) = (side.describe() for side in sides)
        results.update(target={"a": a, "b": b}, server={"a": a_info, "b": b_info})

    results.update(mode="paired", variants=[])
    describe_sides()

    async def point(item, c: int) -> dict:
        async with sides[0].sender(c) as send_a, sides[1].sender(c) as send_b:
            reqs = item.point_requests(c)
            if c == 1:
                bar = progress_bar(len(reqs), f"{item.name} pairs", args.progress)
                a, b = await run_pairs(reqs, send_a, send_b, time_limit=args.time_limit, on_done=bar.update)
                bar.close()
                return summarize_variant(item.name, a, b)
            bar = progress_bar(args.blocks, f"{item.name} c={c} blocks", args.progress)
            blocks, wrapped = await run_blocks(reqs, c, send_a, send_b, blocks=args.blocks,
                                               block_s=args.block_seconds, on_done=bar.update)
            bar.close()
            return {"variant": item.name, "concurrency": c, "requests": len(reqs), "block_seconds": args.block_seconds,
                    "wrapped": wrapped, **blocks_summary(blocks), "blocks": blocks}

    async def go():
        if engine is not None:
            log(f"starting vLLM (raw embed pooling) on {args.versus_raw}")
            await engine.start()
            log(f"engine ready in {engine.start_s:.1f}s")
            describe_sides()
        try:
            with steady_heap(log):
                for item in plan:
                    for side in sides:
                        if item.warm:
                            async with side.sender(1) as send:
                                await closed_loop(item.warm, 1, send)
                    for c in item.concurrencies:
                        results["variants"].append(await point(item, c))
                        log(f"{item.name} c={c}: B/A {results['variants'][-1]['ratio']}")
                        out.write_text(dumps(results) + "\n")
        finally:
            if engine is not None:
                await engine.finish_profile()
                engine.close()

    asyncio.run(go())
    results["complete"] = True
    table = paired_table(results)
    out.write_text(dumps(results) + "\n")
    out.with_suffix(".txt").write_text(table + "\n")
    print(table)
    log(f"results: {out} (table: {out.with_suffix('.txt')})")
    bad = [v for v in results["variants"] if v.get("unpaired") or v.get("unanswered")]
    return 1 if (bad and args.fail_on_error) else 0


@contextlib.contextmanager
def steady_heap(log: Callable[[str], None]):
    """clef-bench measures with its objects so far out of the garbage collector's full collections
    (:func:`clef_vllm.util.heap.frozen_heap`)."""
    with frozen_heap() as frozen:
        log(f"garbage collector: {frozen} objects frozen while measuring")
        yield


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.compare:
        return _compare(args)
    if bool(args.url) == bool(args.raw_vllm):
        build_parser().error("give a server URL or --raw-vllm MODEL_DIR (not both)")
    if args.versus_raw and (args.versus or not args.url):
        build_parser().error("--versus-raw needs a server URL (A) and no --versus")
    raw = args.raw_vllm is not None
    raw_dir = args.raw_vllm or args.versus_raw          # whose engine embeds token ids (the requests keep them)
    headers = parse_headers(args.header)
    tokenizer = args.tokenizer or raw_dir
    factory = None
    if tokenizer:
        from clef_vllm.model.demo import describe_demo, is_demo, resolve_model_dir
        from clef_vllm.schema.encoding import RequestEncoder

        tokenizer = resolve_model_dir(tokenizer)       # "demo" -> the demo checkpoint; never a model hub
        if is_demo(args.tokenizer or raw_dir):
            log(describe_demo(tokenizer))
        if not tokenizer.is_dir():
            build_parser().error(f"--tokenizer {tokenizer}: no such folder (give a checkpoint folder or 'demo'; "
                                 "names are never looked up on a model hub)")
        tokenizer = str(tokenizer)
        encoder = RequestEncoder.from_pretrained(tokenizer, max_length=args.max_model_len)
        factory = RequestFactory(encoder, seed=args.seed, model=args.model_name, keep_ids=raw_dir is not None)
    elif raw:
        build_parser().error("--raw-vllm needs a tokenizer")

    created = dt.datetime.now(dt.timezone.utc)
    results: dict[str, Any] = {
        "schema": f"clef-bench/{RESULT_SCHEMA_VERSION}",
        "tool": "clef-bench", "clef_vllm_version": __version__,
        "created_utc": created.isoformat(timespec="seconds"),
        "argv": ["clef-bench", *(argv if argv is not None else sys.argv[1:])],
        "mode": "raw-vllm" if raw else "http",
        "label": args.label,
        "settings": {"seed": args.seed, "tokenizer": tokenizer, "max_model_len": args.max_model_len,
                     "warmup": args.warmup, "time_limit_s": args.time_limit, "timeout_s": args.timeout,
                     "num_requests": args.num_requests or "auto", "workload": args.workload,
                     "requests_file": args.requests},
        "environment": environment(),
    }
    out = Path(args.output or f"clef-bench-{created:%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(points: list[dict], complete: bool) -> None:
        """Write the results so far (a run killed by a timeout keeps its finished points)."""
        results["points"] = points
        results["complete"] = complete
        if complete:
            results["finished_utc"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        out.write_text(dumps(results) + "\n")
        out.with_suffix(".txt").write_text(bench_table(results) + "\n")

    if args.versus or args.versus_raw:
        if raw or not args.url:
            build_parser().error("--versus needs a server URL (A) and compares it with URL_B")
        return _paired(args, factory, headers, results, out, log)
    plan = make_plan(args, factory, log)
    if raw:
        _embeddable_only(plan)
    results["variants"] = [item.describe() for item in plan]

    if raw:
        engine = _raw_engine(args, args.raw_vllm)

        @contextlib.asynccontextmanager
        async def session(c: int):
            yield engine

        async def go():
            log(f"starting vLLM (raw embed pooling) on {args.raw_vllm}")
            await engine.start()
            log(f"engine ready in {engine.start_s:.1f}s")
            results["target"] = {"kind": "raw-vllm", "model_dir": args.raw_vllm, **engine.describe()}
            try:
                with steady_heap(log):
                    return await run_plan(plan, session, time_limit=args.time_limit, progress=args.progress, log=log,
                                          on_point=lambda pts: save(pts, False))
            finally:
                results["target"] = {"kind": "raw-vllm", "model_dir": args.raw_vllm, **engine.describe()}
                await engine.finish_profile()
                engine.close()

        results["target"] = {"kind": "raw-vllm", "model_dir": args.raw_vllm}
        points = asyncio.run(go())
    else:
        _wait_until_ready((args.url,), args.wait_ready, headers, log)
        results["target"] = {"kind": "http", "url": systemone_url(args.url)}
        results["server"] = server_info(args.url, headers)
        with steady_heap(log):
            points = asyncio.run(run_plan(plan, http_session_factory(args.url, args.timeout, headers),
                                          time_limit=args.time_limit, progress=args.progress, log=log,
                                          on_point=lambda pts: save(pts, False)))
    save(points, True)
    print(bench_table(results))
    log(f"results: {out} (table: {out.with_suffix('.txt')})")
    bad = [p for p in points if p["unexpected_status"] or p["input_tokens"]["mismatches"]]
    if bad:
        log(f"WARNING: {len(bad)} point(s) with unexpected statuses or token-count mismatches")
    unanswered = [p for p in points if not p["ok"]]
    if unanswered:              # nothing was measured (a wrong key, a wrong URL): a failed run, flag or not
        log(f"FAIL: {len(unanswered)} point(s) without a single answer (errors: {unanswered[0]['errors']})")
        return 1
    return 1 if (bad and args.fail_on_error) else 0


if __name__ == "__main__":
    sys.exit(main())
