"""``clef-parity``: do two Clef servers or backends give the same answers, beyond their own noise?

  clef-parity reference:CKPT http://127.0.0.1:8000                       # offline reference vs our server
  clef-parity http://gpu:8000 http://other:8000 --requests held_out.jsonl  # any two endpoints

A and B are each an ``http(s)://`` URL of a ``/v1/systemone`` endpoint or an offline backend spec
``reference:DIR`` / ``vllm:DIR`` / ``auto:DIR``. Both answer the same request set (a file, and/or
a seeded synthetic set) at the same concurrency and order. Per question type the receipt gives
top-1 agreement, mean TV, mean KL, max |Δp| and every flip with A's top-2 margin.

Records with an answer key (build_data's ``answer``) also give each side's top-1 accuracy.

The noise floor runs one side again under another batch composition: serially (concurrency 1)
and in a shuffled order, and compares it with that side's own main pass. A vs B differences at
the size of the noise floor are not evidence of a bug. Details: docs/bench.md.

Exit status: 0 when every request was answered or refused as invalid (400, 413, 415, 422; and,
with --fail-below, the agreement is high enough); 1 when any request of any pass got no answer for
another reason (401, 429, 5xx, a timeout, no connection: the receipt is still written, and the
failures are counted on stderr) or the agreement is below --fail-below; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path
from typing import Any

from clef_vllm.bench import RESULT_SCHEMA_VERSION
from clef_vllm.bench.loadgen import dumps, parse_headers, wait_ready
from clef_vllm.bench.parity import accuracy, compare_runs, count_questions
from clef_vllm.bench.raw_vllm import parse_engine_arg
from clef_vllm.bench.report import parity_markdown, parity_table
from clef_vllm.bench.targets import Answered, Condition, Target, open_target
from clef_vllm.bench.workloads import request_set_digest, synthetic_parity_set
from clef_vllm.schema.records import load_request_file
from clef_vllm.version import __version__

DEFAULT_SYNTHETIC = 64


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clef-parity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"clef-vllm {__version__}")
    p.add_argument("a", metavar="A", help="reference side: URL or BACKEND:DIR")
    p.add_argument("b", metavar="B", help="compared side: URL or BACKEND:DIR")
    r = p.add_argument_group("request set")
    r.add_argument("--requests", metavar="FILE.jsonl",
                   help="one SystemOne body per line (extra keys such as answer/source are ignored; "
                        "'id' labels the record)")
    r.add_argument("--limit", type=int, default=None, help="read at most this many records")
    r.add_argument("--synthetic", type=int, default=None, metavar="N",
                   help=f"N generated requests (default {DEFAULT_SYNTHETIC} when no --requests)")
    r.add_argument("--synthetic-max-words", type=int, default=400, metavar="W",
                   help="longest synthetic text state, in words (default 400)")
    r.add_argument("--synthetic-states", type=int, default=None, metavar="K",
                   help="synthetic request i asks about the state of request i %% K: repeated states, "
                        "for a server with --state-cache on (default: every state new)")
    r.add_argument("--seed", type=int, default=0, help="synthetic set and shuffle seed")
    r.add_argument("--model-name", default="clef-flash")

    c = p.add_argument_group("conditions")
    c.add_argument("-c", "--concurrency", type=int, default=8,
                   help="main pass: requests in flight (HTTP) or batch size (offline), request order (default 8)")
    c.add_argument("--noise-floor", choices=["a", "b", "both", "none"], default="a",
                   help="which side to run a second time for the noise floor (default a)")
    c.add_argument("--noise-concurrency", type=int, default=1,
                   help="noise pass concurrency / batch size, in shuffled order (default 1: serial)")
    c.add_argument("--timeout", type=float, default=600.0, help="per-request HTTP timeout, seconds")
    c.add_argument("--header", action="append", default=[], metavar="'Name: value'",
                   help="extra HTTP header; without an Authorization header, the first key of $CLEF_API_KEY "
                        "(as clef-systemone reads it) is sent as 'Authorization: Bearer KEY'")
    c.add_argument("--wait-ready", type=float, default=0.0, metavar="S",
                   help="first wait up to S seconds for an HTTP side's GET /health to say 200")

    o = p.add_argument_group("offline backends (BACKEND:DIR)")
    o.add_argument("--device", default=None, help="reference backend device (cpu / cuda); reference targets only")
    o.add_argument("--dtype", default=None, help="model dtype (bfloat16; float32 = a float32 reference model)")
    o.add_argument("--head-dtype", default=None, help="the head's dtype when it differs (bfloat16 / float32)")
    o.add_argument("--max-model-len", type=int, default=None)
    o.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Clef()/backend option (clef_vllm.backends.options), VALUE as JSON when it parses "
                        "(e.g. gpu_memory_utilization=0.6)")

    out = p.add_argument_group("output")
    out.add_argument("-o", "--output", metavar="RECEIPT.json", help="JSON receipt (default clef-parity-<time>.json)")
    out.add_argument("--summary", metavar="SUMMARY.md", help="markdown summary (default: receipt name with .md)")
    out.add_argument("--max-flips", type=int, default=200, help="flips listed in the receipt")
    out.add_argument("--label", default=None)
    out.add_argument("--no-progress", dest="progress", action="store_false")
    out.add_argument("--fail-below", type=float, default=None, metavar="AGREEMENT",
                     help="exit 1 if overall A-vs-B top-1 agreement is below this (e.g. 0.99)")
    return p


def load_set(args) -> tuple[list[dict], list[str], list[dict | None], dict]:
    """Bodies, labels, answer keys (file records that carry ``answer``) and the set's description."""
    bodies, labels, keys = [], [], []
    sources = []
    if args.requests:
        records = load_request_file(args.requests, args.limit, args.model_name)
        bodies += [r.body for r in records]
        labels += [r.label for r in records]
        keys += [r.answer for r in records]
        sources.append(f"file {args.requests}")
    n_syn = args.synthetic if args.synthetic is not None else (0 if args.requests else DEFAULT_SYNTHETIC)
    if n_syn:
        syn = synthetic_parity_set(n_syn, seed=args.seed, model=args.model_name, max_words=args.synthetic_max_words,
                                   states=args.synthetic_states)
        bodies += syn
        labels += [f"syn{i}" for i in range(n_syn)]
        keys += [None] * n_syn
        shared = f", {args.synthetic_states} states" if args.synthetic_states else ""
        sources.append(f"synthetic (seed {args.seed}, n {n_syn}, ≤{args.synthetic_max_words} words{shared})")
    if not bodies:
        raise SystemExit("clef-parity: empty request set")
    info = {"source": " + ".join(sources), "requests": len(bodies), "questions": count_questions(bodies),
            "answer_keys": sum(1 for k in keys if k), "sha256": request_set_digest(bodies), "file": args.requests,
            "synthetic": n_syn, "synthetic_states": args.synthetic_states, "seed": args.seed}
    return bodies, labels, keys, info


def is_http(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def run_side(spec: str, args, bodies: list[dict], conditions: list[Condition],
             log) -> tuple[dict, list[list[Answered]]]:
    """Open one side, answer every condition, close it (so two GPU backends never coexist)."""
    from tqdm import tqdm

    options: dict[str, Any] = dict(parse_engine_arg(a) for a in args.engine_arg)
    device = args.device if spec.startswith("reference:") else None    # vLLM engines place themselves
    options.update({k: v for k, v in (("device", device), ("dtype", args.dtype), ("head_dtype", args.head_dtype),
                                      ("max_model_len", args.max_model_len)) if v is not None})
    log(f"opening {spec}")
    headers = parse_headers(args.header)
    if args.wait_ready > 0 and is_http(spec):
        try:
            log(f"waiting for {spec}: {wait_ready(spec, args.wait_ready, headers)}")
        except TimeoutError as exc:
            raise SystemExit(f"clef-parity: {exc}") from None
    target: Target = open_target(spec, timeout=args.timeout, headers=headers, **options)
    try:
        info = target.describe()
        runs = []
        for cond in conditions:
            bar = tqdm(total=len(bodies), desc=f"{spec} [{cond.name}]", leave=False, disable=not args.progress,
                       file=sys.stderr, dynamic_ncols=True)
            runs.append(target.answer(bodies, cond, progress=bar.update))
            bar.close()
            ok = sum(r.ok for r in runs[-1])
            log(f"{spec} [{cond.name}]: {ok}/{len(bodies)} answered")
        return info, runs
    finally:
        target.close()


#: Statuses that refuse the request itself (it is invalid or too large for the model): both sides refusing
#: a record is agreement, counted in the comparison. Any other failure (401, 429, 5xx, a timeout, no
#: connection) means the side did not answer, and the run fails.
REFUSALS = frozenset({"400", "413", "415", "422"})


def failures(sides: dict[str, dict]) -> list[str]:
    """One line per pass with requests that got no answer for a reason other than the request itself
    (:data:`REFUSALS`): how many, and the first error."""
    lines = []
    for side, data in sides.items():
        for run in data["runs"]:
            bad = [r for r in run if not r.ok and r.status not in REFUSALS]
            if bad:
                first = bad[0]
                lines.append(f"{side.upper()}: {len(bad)} of {len(run)} requests failed (first: {first.status} "
                             f"{(first.error or '')[:200]})")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    bodies, labels, keys, set_info = load_set(args)
    main_cond = Condition("main", args.concurrency, "request")
    noise_cond = Condition("noise", args.noise_concurrency, "shuffled", args.seed)
    noise_sides = {"a": ["a"], "b": ["b"], "both": ["a", "b"], "none": []}[args.noise_floor]
    created = dt.datetime.now(dt.timezone.utc)

    sides: dict[str, dict] = {}
    for side, spec in (("a", args.a), ("b", args.b)):
        conds = [main_cond] + ([noise_cond] if side in noise_sides else [])
        info, runs = run_side(spec, args, bodies, conds, log)
        sides[side] = {"info": info, "runs": runs}

    comparison = compare_runs(labels, sides["a"]["runs"][0], sides["b"]["runs"][0], max_flips=args.max_flips)
    noise = {}
    for side in noise_sides:
        runs = sides[side]["runs"]
        noise[side.upper()] = {"condition": noise_cond.describe(),
                               "comparison": compare_runs(labels, runs[0], runs[1], max_flips=args.max_flips)}
    receipt = {
        "schema": f"clef-parity/{RESULT_SCHEMA_VERSION}",
        "tool": "clef-parity", "clef_vllm_version": __version__,
        "created_utc": created.isoformat(timespec="seconds"),
        "argv": ["clef-parity", *(argv if argv is not None else sys.argv[1:])],
        "label": args.label,
        "a": sides["a"]["info"], "b": sides["b"]["info"],
        "request_set": set_info,
        "conditions": {"main": main_cond.describe(), "noise": noise_cond.describe(),
                       "noise_sides": [s.upper() for s in noise_sides]},
        "comparison": comparison,
        "noise_floor": noise,
        "accuracy": ({side.upper(): accuracy(sides[side]["runs"][0], bodies, keys) for side in ("a", "b")}
                     if any(keys) else None),
        "finished_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    out = Path(args.output or f"clef-parity-{created:%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(receipt) + "\n")
    summary = Path(args.summary) if args.summary else out.with_suffix(".md")
    summary.write_text(parity_markdown(receipt))
    print(parity_table(receipt))
    log(f"receipt: {out}\nsummary: {summary}")
    failed = failures(sides)
    for line in failed:
        log(f"FAIL: {line}")
    agreement = comparison["overall"]["top1_agreement"]
    if failed:
        return 1
    if args.fail_below is not None and (agreement is None or agreement < args.fail_below):
        log(f"FAIL: top-1 agreement {agreement} < {args.fail_below}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
