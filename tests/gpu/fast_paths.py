"""GPU checks of the two engine features on a tiny checkpoint: prefill graphs and the state cache.

    python3 tests/gpu/fast_paths.py --out $OUT [--n 120] [--scope core|layer|step]
        [--only graphs,cache,eviction,memo,nvfp4,api,split]

1. **graphs**: the same requests (varied lengths, some longer than a step's token budget, so
   chunked), ONE AT A TIME, through an engine with prefill and head graphs and one without (state cache
   off in both): per-option probabilities compared (how many bit-identical, max |dp|, top-answer
   flips), and the worker's graph counters (replays, fallbacks by reason). ``--scope layer``: the
   prefill graphs hold vLLM's whole packed GDN op (``--prefill-graph-scope layer``); ``--scope step``:
   single-sequence steps replay the whole backbone from one graph (``--prefill-graph-scope step``).
2. **state cache** (graphs on, of ``--scope``): a hit on a whole state (B after A), a partial hit (D after C,
   which share the first 60 % of A's state and diverge), concurrent same-state requests (8 cold
   together, then 8 that hit), and eviction (a side pool of 4 blocks and a small KV cache while
   6 other states pass through) -- every cached answer against the same request recomputed with
   ``skip_reading_prefix_cache`` in the same engine.
3. **metadata memo**: a short and a long (chunked) request one at a time (with the graphs: their step
   graphs captured, for a capturing step runs the per-layer path), the memo emptied, both again (the
   metadata built), another length, both a third time: the third runs take their GDN metadata from the
   memo of one-sequence prefills (``clef_vllm/worker/fast/gdn_metadata.py``; the worker's ``built`` /
   ``reused`` counts say so) and must answer bit-identically to the second, on vLLM's path and with the
   graphs.
4. **nvfp4**: a tiny Hybrid (FP8 W8A8 layers 0-1, NVFP4 W4A4 layers 2-3: ``scripts/quantize_mixed.py --engine
   native`` and ``scripts/shrink_tables.py`` on the tiny release checkpoint) through an engine with vLLM's NVFP4
   kernel (Marlin W4A16 on Hopper) and one with ``--nvfp4-kernel bf16`` (the weights dequantized to BF16 at
   load), neither with the plugin's graphs: the same requests one at a time, compared as in part 1 (W4A16
   both: the BF16 noise floor).
5. **offline API**: ``Clef(backend="vllm")`` (AsyncLLM: leader/follower and affinity) answers 12
   requests about one state in one batch; how many read the state from the cache, and the answers
   against the reference backend.
6. **split**: small batches (2-5 requests submitted together) through an engine with whole-step graphs and
   ``--step-graph-split 4`` and one with ``0``: each request alone first (three times: its graphs captured, then
   replayed), then its group. With the split, a group of up to 4 answers bit-identically to its requests alone; the worker's
   counters say how many steps were split; the groups against vLLM's batched path.

Every engine runs in its own subprocess (in-process engine core: the script reads the worker's
counters and this process's side cache directly). Results: ``$OUT/fast_paths.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from clef_vllm.backends.options import VllmOptions
from clef_vllm.contract import DEFAULT_STEP_GRAPH_SPLIT, PREFILL_GRAPH_SCOPES

HERE = Path(__file__).resolve()


# --------------------------------------------------------------------------- child: one engine


def encode(encoder, body: dict, keyed: bool):
    from clef_vllm.model.features import HeadSpec
    from clef_vllm.schema.dialects import parse_request

    enc = encoder.encode(parse_request(body))
    return enc, HeadSpec.from_encoded(enc, state_keys=keyed)


def run_engine(config: dict) -> dict:
    import logging

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if os.environ.get("CLEF_DUMP_AFTER"):            # diagnose a hang: every thread's stack, then exit
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["CLEF_DUMP_AFTER"]), exit=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from vllm import LLM, TokensPrompt

    from clef_vllm import register
    from clef_vllm.backends.vllm_backend import engine_kwargs, pooling_params
    from clef_vllm.contract import with_settings
    from clef_vllm.schema.encoding import RequestEncoder
    from clef_vllm.worker.fast import state_cache

    register()
    ckpt = Path(config["ckpt"])
    kw = engine_kwargs(ckpt, gpu_memory_utilization=0.3, max_num_seqs=32, max_num_batched_tokens=2048,
                       max_model_len=4096, prefill_graphs=config["graphs"], head_graphs=config["graphs"],
                       state_cache=config["cache"], nvfp4_kernel=config.get("nvfp4_kernel", "vllm"),
                       prefill_graph_scope=config.get("scope") if config["graphs"] else None,
                       **({"step_graph_split": config["step_graph_split"]} if "step_graph_split" in config else {}))
    kw.pop("disable_log_stats", None)
    if config.get("capacity_blocks"):
        with_settings(kw, state_cache_blocks=config["capacity_blocks"])
    if config.get("num_gpu_blocks"):
        kw["num_gpu_blocks_override"] = config["num_gpu_blocks"]
    llm = LLM(**kw)
    encoder = RequestEncoder.from_pretrained(ckpt, max_length=4096)
    out: dict = {"config": {k: v for k, v in config.items() if k != "program"}, "steps": [], "forgotten": []}

    def forget_memo(worker) -> int:
        """Empty the GDN builders' memos of one-sequence prefills; how many builders had one."""
        from clef_vllm.worker.fast import gdn_metadata

        emptied = 0
        for groups in worker.model_runner.attn_groups:
            for group in groups:
                for builder in group.metadata_builders:
                    emptied += builder.__dict__.pop(gdn_metadata.MEMO, None) is not None
        return emptied

    for step in config["program"]:                   # a step: requests submitted together
        if step.get("forget_memo"):
            out["forgotten"].append(llm.collective_rpc(forget_memo)[0])
            continue
        prompts, params, encs = [], [], []
        for body, skip in zip(step["bodies"], step.get("skip", [False] * len(step["bodies"]))):
            enc, spec = encode(encoder, body, keyed=config["cache"])
            prompts.append(TokensPrompt(prompt_token_ids=enc.input_ids))
            params.append(pooling_params(spec, reads=config["cache"] and not skip))
            encs.append(enc)
        results = llm.encode(prompts, pooling_params=params, pooling_task="plugin", use_tqdm=False)
        out["steps"].append({"name": step["name"], "results": [
            {"probs": r.outputs.data.float().reshape(-1).tolist(), "cached": int(r.num_cached_tokens or 0),
             "tokens": e.num_tokens}
            for r, e in zip(results, encs)]})

    def report(worker):
        from clef_vllm.worker.fast import gdn_metadata

        model = worker.model_runner.model
        rep = {"block_size": worker.vllm_config.cache_config.block_size,
               "num_gpu_blocks": worker.vllm_config.cache_config.num_gpu_blocks,
               "gdn_metadata_memo": dict(gdn_metadata.STATS)}
        rep.update((f"{name}_graphs", runner.describe()) for name, runner in model.graph_runners().items())
        return rep

    out["worker"] = llm.collective_rpc(report)[0]
    cache = state_cache.current()
    out["side_cache"] = cache.describe() if cache is not None else None
    return out


# --------------------------------------------------------------------------- parent


def tiny_hybrid(work: Path) -> Path:
    """FP8 W8A8 layers 0-1 + NVFP4 W4A4 layers 2-3 of a tiny release checkpoint at Marlin-sized widths
    (hidden 256), int8 tables (the tools' pipeline with the native exporter, on the CPU: seconds)."""
    from clef_vllm.model.tiny import build_tiny_checkpoint
    from clef_vllm.testing.hybrid import build_tiny_hybrid

    release = build_tiny_checkpoint(work / "tiny-release", layout="release", hidden=256)
    return build_tiny_hybrid(release, work)


def child(config: dict, workdir: Path, name: str) -> dict:
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(config))
    log_path = Path(os.environ.get("OUT", workdir)) / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, str(HERE), "--child", str(path)], stdout=log, stderr=subprocess.STDOUT)
    result = workdir / f"{name}.out.json"
    if proc.returncode or not result.exists():
        return {"error": proc.returncode, "log": str(log_path)}
    return json.loads(result.read_text())


def compare(a: list[list[float]], b: list[list[float]]) -> dict:
    diffs = [max(abs(x - y) for x, y in zip(p, q)) for p, q in zip(a, b)]
    identical = sum(p == q for p, q in zip(a, b))
    flips = sum(max(range(len(p)), key=p.__getitem__) != max(range(len(q)), key=q.__getitem__) for p, q in zip(a, b))
    return {"requests": len(a), "bit_identical": identical, "max_abs_dp": max(diffs) if diffs else 0.0,
            "mean_abs_dp": sum(diffs) / max(len(diffs), 1), "argmax_flips_over_all_options": flips}


def state(words: int, seed: int) -> str:
    import random

    r = random.Random(seed)
    vocab = ("customer order invoice refund ticket checkout outage deployment server latency error alert "
             "payment account region cluster team manager escalated failed recovered delayed").split()
    return " ".join(r.choice(vocab) for _ in range(words))


def questions(seed: int) -> dict:
    import random

    r = random.Random(seed)
    return {f"q{seed}": {"type": "choice", "instructions": f"Which team, case {r.randint(0, 999)}?",
                         "criteria": {"billing": "Payments", "technical": "Outages", "sales": "Plans"}},
            f"u{seed}": {"type": "noul", "instructions": "Is this urgent?"},
            f"s{seed}": {"type": "score", "criteria": ["low", "mid", "high"]}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    ap.add_argument("--n", type=int, default=120)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--only", default="graphs,cache,eviction,memo,nvfp4,api,split", help="which parts to run")
    ap.add_argument("--scope", default=VllmOptions().resolved_prefill_graph_scope, choices=PREFILL_GRAPH_SCOPES,
                    help="the prefill graph scope of the engines with graphs (--prefill-graph-scope; default: the "
                         "server's): part 1 compares it "
                         "with vLLM's path, parts 2-3 run the state cache on it")
    args = ap.parse_args()
    if args.child:
        config = json.loads(Path(args.child).read_text())
        res = run_engine(config)
        Path(args.child[:-5] + ".out.json").write_text(json.dumps(res))
        return 0

    from clef_vllm.bench.workloads import synthetic_parity_set
    from clef_vllm.model.tiny import build_tiny_checkpoint

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="clef-fast-"))
    ckpt = build_tiny_checkpoint(work / "tiny", layout="repacked", mtp=True)
    report: dict = {}

    parts = set(args.only.split(","))

    def save():
        (out / "fast_paths.json").write_text(json.dumps(report, indent=1) + "\n")

    requests = args.n                               # part 1's and part 4's
    # 1. graphs vs vLLM's path, one request at a time
    if "graphs" not in parts:
        args.n = 0
    bodies = synthetic_parity_set(args.n, seed=11, max_words=1500)
    program = [{"name": f"r{i}", "bodies": [b]} for i, b in enumerate(bodies)]
    runs = {g: child({"ckpt": str(ckpt), "graphs": g, "cache": False, "scope": args.scope, "program": program},
                     work, f"graphs_{g}")
            for g in (True, False)} if program else {}
    if runs and all("steps" in r for r in runs.values()):
        probs = {g: [s["results"][0]["probs"] for s in r["steps"]] for g, r in runs.items()}
        report["graphs_vs_vllm_path"] = {**compare(probs[False], probs[True]),
                                         "tokens": [s["results"][0]["tokens"] for s in runs[True]["steps"]],
                                         "worker_graphs_on": runs[True]["worker"],
                                         "worker_graphs_off": runs[False]["worker"]}
    else:
        report["graphs_vs_vllm_path"] = runs
    print(json.dumps({k: v for k, v in report.get("graphs_vs_vllm_path", {}).items() if k != "tokens"}), flush=True)
    save()

    # 2. state cache cases
    s1, s2 = state(1400, 1), state(1400, 2)
    cut = s1.split()[:840]
    c_state, d_state = " ".join(cut + ["alpha"] * 300), " ".join(cut + ["omega"] * 300)

    def req(st, q):
        return {"model": "m", "state": st, "questions": questions(q)}

    a, b, c, d = req(s1, 1), req(s1, 2), req(c_state, 3), req(d_state, 4)
    group = [req(s2, 10 + i) for i in range(8)]
    group2 = [req(s2, 20 + i) for i in range(8)]
    program = [
        {"name": "A", "bodies": [a]}, {"name": "B_hit", "bodies": [b]}, {"name": "B_uncached", "bodies": [b], "skip": [True]},
        {"name": "C", "bodies": [c]}, {"name": "D_partial_hit", "bodies": [d]},
        {"name": "D_uncached", "bodies": [d], "skip": [True]},
        {"name": "same_state_cold", "bodies": group}, {"name": "same_state_cold_uncached", "bodies": group, "skip": [True] * 8},
        {"name": "same_state_hit", "bodies": group2}, {"name": "same_state_hit_uncached", "bodies": group2, "skip": [True] * 8},
    ]
    sc = child({"ckpt": str(ckpt), "graphs": True, "cache": True, "scope": args.scope, "program": program}, work,
               "state_cache") \
        if "cache" in parts else {}
    if "steps" in sc:
        steps = {s["name"]: s["results"] for s in sc["steps"]}

        def pair(hit, ref):
            return {"cached_tokens": [r["cached"] for r in steps[hit]], "tokens": [r["tokens"] for r in steps[hit]],
                    **compare([r["probs"] for r in steps[ref]], [r["probs"] for r in steps[hit]])}

        report["state_cache"] = {"full_hit": pair("B_hit", "B_uncached"), "partial_hit": pair("D_partial_hit", "D_uncached"),
                                 "first_of_state": {"A": steps["A"][0]["cached"], "C": steps["C"][0]["cached"]},
                                 "concurrent_cold": pair("same_state_cold", "same_state_cold_uncached"),
                                 "concurrent_after": pair("same_state_hit", "same_state_hit_uncached"),
                                 "worker": sc["worker"], "side_cache": sc["side_cache"]}
    else:
        report["state_cache"] = sc
    print(json.dumps(report["state_cache"]), flush=True)
    save()

    # eviction: a 4-block side pool and a small KV cache
    others = [req(state(1400, 100 + i), 30 + i) for i in range(6)]
    program = ([{"name": "A", "bodies": [a]}] + [{"name": f"other{i}", "bodies": [o]} for i, o in enumerate(others)]
               + [{"name": "B_after", "bodies": [b]}, {"name": "B_uncached", "bodies": [b], "skip": [True]},
                  {"name": "other5_again", "bodies": [req(state(1400, 105), 99)]},
                  {"name": "other5_again_uncached", "bodies": [req(state(1400, 105), 99)], "skip": [True]}])
    ev = child({"ckpt": str(ckpt), "graphs": True, "cache": True, "scope": args.scope, "capacity_blocks": 4,
                "num_gpu_blocks": 96,
                "program": program}, work, "eviction") if "eviction" in parts else {}
    if "steps" in ev:
        steps = {s["name"]: s["results"] for s in ev["steps"]}
        report["eviction"] = {
            "B_after_evictions": {"cached": steps["B_after"][0]["cached"],
                                  **compare([steps["B_uncached"][0]["probs"]], [steps["B_after"][0]["probs"]])},
            "recent_state": {"cached": steps["other5_again"][0]["cached"],
                             **compare([steps["other5_again_uncached"][0]["probs"]], [steps["other5_again"][0]["probs"]])},
            "worker": ev["worker"], "side_cache": ev["side_cache"]}
    else:
        report["eviction"] = ev
    print(json.dumps(report["eviction"]), flush=True)
    save()
    # 3. the GDN metadata memo: a one-sequence prefill of a length built before takes its metadata from the
    # memo (state lines recomputed); the same request again must answer bit-identically, on vLLM's path (which
    # reads every field) and with the graphs
    if "memo" in parts:
        short, long_, other = req(state(150, 50), 50), req(state(1400, 51), 51), req(state(400, 52), 52)
        runs = (("short0", short), ("long0", long_), ("forget", None), ("short1", short), ("long1", long_),
                ("other", other), ("short2", short), ("long2", long_))
        program = [{"name": name, "forget_memo": True} if body is None else {"name": name, "bodies": [body]}
                   for name, body in runs]
        report["metadata_memo"] = {}
        for graphs in (False, True):
            run = child({"ckpt": str(ckpt), "graphs": graphs, "cache": False, "scope": args.scope, "program": program},
                        work, f"memo_{'graphs' if graphs else 'vllm_path'}")
            if "steps" not in run:
                report["metadata_memo"]["graphs" if graphs else "vllm_path"] = run
                continue
            got = {st["name"]: st["results"][0] for st in run["steps"]}
            report["metadata_memo"]["graphs" if graphs else "vllm_path"] = {
                "short": {"tokens": got["short1"]["tokens"], **compare([got["short1"]["probs"]], [got["short2"]["probs"]])},
                "long": {"tokens": got["long1"]["tokens"], **compare([got["long1"]["probs"]], [got["long2"]["probs"]])},
                "memo": run["worker"]["gdn_metadata_memo"], "memos_emptied": run["forgotten"],
                "step_graphs": run["worker"].get("step_graphs")}
        print(json.dumps(report["metadata_memo"]), flush=True)
        save()
    # 4. NVFP4 layers: vLLM's kernel against the weights dequantized to BF16 at load, on a tiny Hybrid
    if "nvfp4" in parts:
        hybrid = tiny_hybrid(work)
        bodies = synthetic_parity_set(requests, seed=13, max_words=1500)
        program = [{"name": f"r{i}", "bodies": [b]} for i, b in enumerate(bodies)]
        # without the plugin's graphs: the kernels are the question, and two engines' captures and checks took
        # 300 s for this part
        runs = {k: child({"ckpt": str(hybrid), "graphs": False, "cache": False, "nvfp4_kernel": k,
                          "program": program}, work, f"nvfp4_{k}") for k in ("vllm", "bf16")}
        if all("steps" in r for r in runs.values()):
            probs = {k: [st["results"][0]["probs"] for st in r["steps"]] for k, r in runs.items()}
            report["nvfp4_bf16_vs_vllm"] = {**compare(probs["vllm"], probs["bf16"]),
                                            "tokens": [st["results"][0]["tokens"] for st in runs["bf16"]["steps"]]}
        else:
            report["nvfp4_bf16_vs_vllm"] = runs
        print(json.dumps({k: v for k, v in report["nvfp4_bf16_vs_vllm"].items() if k != "tokens"}), flush=True)
        save()
    # 6. small batches replayed one sequence at a time (--step-graph-split): each request alone (three times: the
    # first captures the bucket's GDN graphs, the second its step graph, the third replays it), then its group
    # submitted together; with the split a request's answer in
    # its group must be bit-identical to its answer alone (the same graph, the same inputs), without it the
    # group runs vLLM's batched path (the BF16 noise floor)
    if "split" in parts:
        bodies = synthetic_parity_set(18, seed=17, max_words=60)   # 2 groups over 2,048 tokens or 4 requests
        sizes, groups_, at = (2, 3, 4, 5, 2, 2), [], 0
        for size in sizes:
            groups_.append(bodies[at:at + size])
            at += size
        program = []
        for g, group in enumerate(groups_):
            program += [{"name": f"warm{g}_{i}_{w}", "bodies": [b]} for w in range(2) for i, b in enumerate(group)]
            program += [{"name": f"alone{g}_{i}", "bodies": [b]} for i, b in enumerate(group)]
            program.append({"name": f"group{g}", "bodies": group})
        report["split"] = {}
        runs = {}
        for split in (DEFAULT_STEP_GRAPH_SPLIT, 0):
            name = f"split{split}"
            runs[name] = run = child({"ckpt": str(ckpt), "graphs": True, "cache": False, "scope": "step",
                                      "step_graph_split": split, "program": program}, work, name)
            if "steps" not in run:
                report["split"][name] = run
                continue
            got = {st["name"]: st["results"] for st in run["steps"]}
            report["split"][name] = {
                "groups": [{"requests": len(group), "tokens": [r["tokens"] for r in got[f"group{g}"]],
                            **compare([got[f"alone{g}_{i}"][0]["probs"] for i in range(len(group))],
                                      [r["probs"] for r in got[f"group{g}"]])} for g, group in enumerate(groups_)],
                "step_graphs": run["worker"].get("step_graphs")}
        if all("steps" in r for r in runs.values()):
            on, off = ({st["name"]: st["results"] for st in r["steps"]} for r in runs.values())
            names = [f"group{g}" for g in range(len(groups_))]
            report["split"]["groups_split_vs_batched"] = compare([r["probs"] for n in names for r in off[n]],
                                                                 [r["probs"] for n in names for r in on[n]])
        print(json.dumps(report["split"]), flush=True)
        save()
    if "api" not in parts:
        return 0

    # 5. the offline API: leader/follower through AsyncLLM, answers vs the reference backend
    from clef_vllm import Clef

    batch = [req(state(1500, 7), 40 + i) for i in range(12)]
    with Clef(ckpt, backend="vllm", gpu_memory_utilization=0.3, max_num_seqs=32, max_num_batched_tokens=2048) as vl:
        got = vl.systemone_batch(batch)
    with Clef(ckpt, backend="reference", device="cuda") as ref:
        want = ref.systemone_batch(batch)

    def vec(resp):
        return [p for a in resp["answers"].values()
                for p in ([a["noul"]] if a["type"] == "noul" else list(a["probabilities"].values()))]

    report["offline_api_same_state"] = {"cached_state_tokens": [g["usage"]["cached_state_tokens"] for g in got],
                                        "input_tokens": [g["usage"]["input_tokens"] for g in got],
                                        "vs_reference": compare([vec(w) for w in want], [vec(g) for g in got])}
    print(json.dumps(report["offline_api_same_state"]), flush=True)
    (out / "fast_paths.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
