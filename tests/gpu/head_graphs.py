"""GPU check of the head graphs on the release-sized joint head (random weights, bf16; no vLLM needed).

    python3 tests/gpu/head_graphs.py --out $OUT [--n 200]

1. **parity**: ``--n`` random single-record decisions (1-40 fields, 2-6 options each, 30-6,000 memory
   rows), each decided by the eager head and by :class:`HeadGraphRunner` (every graph is captured
   at the first decision, which is timed): max |dp|, how many bit-identical, top-answer flips;
   every case replayed a second time and decided eagerly a second time (how reproducible each
   path is by itself). Exit 1 on a failed capture, no replay, a non-finite answer or a flip.
2. **several**: with ``--records R`` (default 16), ``--n`` / 4 random steps finishing 2-R requests at
   once (1-8 fields, 30-2,000 memory rows each), eager vs graph, the same measures (steps beyond the
   several-record buckets fall back; their count is reported).
3. **time** for one 400-token, 3-field decision (the latency case), and for a step finishing 16 of
   them when R is at least 16, 40 when R is 64: host time to issue the head's work and wall time to
   its result, eager vs graph, median of 50.

Results: ``$OUT/head_graphs.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--records", type=int, default=16, help="the runner's largest record bucket (1-64)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (no graphs there)")
    args = ap.parse_args()
    import torch

    from clef_vllm.model.features import decide_records
    from clef_vllm.model.release import RELEASE_HEAD_CONFIG as CFG
    from clef_vllm.model.tables import Int8RowTable, quantize_rows
    from clef_vllm.testing.head_cases import finished, random_head, random_record
    from clef_vllm.worker.fast.head_graphs import HeadGraphRunner

    torch.manual_seed(0)
    dev = torch.device(args.device)
    head = random_head(CFG).to(dev, torch.bfloat16)
    vocab = 4096
    table = Int8RowTable(*quantize_rows(torch.randn(vocab, CFG.hidden_size) * 0.02))
    table.weight, table.scale = table.weight.to(dev), table.scale.to(dev)
    runner = HeadGraphRunner(head, max_memory=8192, max_records=args.records)
    rng = random.Random(1)

    def record(n_fields: int, length: int):
        X, ids, fields = random_record(rng, n_fields, length, CFG.hidden_size)
        ids = [i % vocab for i in ids]
        return X.to(dev, torch.bfloat16), ids, fields

    def decide_step(recs, graphs):
        """One step in which ``recs`` all finish: their options' probabilities, concatenated."""
        return torch.cat(decide_records(head, table, finished(head, recs), graphs))

    def decide(rec, graphs):
        return decide_step([rec], graphs)

    def compare(graph, eager, again, eager_again):
        diffs = [(g - e).abs().max().item() for g, e in zip(graph, eager)]
        return {
            "cases": len(graph), "max_abs_dp": max(diffs), "median_abs_dp": statistics.median(diffs),
            "bit_identical": sum(torch.equal(g, e) for g, e in zip(graph, eager)),
            "replay_again_identical": sum(torch.equal(g, a) for g, a in zip(graph, again)),
            # the head's segment sums use atomic adds: the eager head is not bit-reproducible either
            "eager_again_identical": sum(torch.equal(e, a) for e, a in zip(eager, eager_again)),
            "eager_again_max_abs_dp": max((e - a).abs().max().item() for e, a in zip(eager, eager_again)),
            "top_flips": sum(int(g.argmax() != e.argmax()) for g, e in zip(graph, eager)),
            "finite": all(bool(torch.isfinite(g).all()) for g in graph),
        }

    res: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "head": CFG.to_dict()}
    with torch.inference_mode():
        cases = [record(rng.randint(1, 40), rng.choice([30, 120, 400, 417, 1000, 2500, 6000])) for _ in range(args.n)]
        eager = [decide(c, None) for c in cases]
        t0 = time.perf_counter()
        graph = [decide(cases[0], runner)]                  # the first decision captures every graph
        res["first_decision_with_captures_s"] = round(time.perf_counter() - t0, 2)
        graph += [decide(c, runner) for c in cases[1:]]
        again = [decide(c, runner) for c in reversed(cases)][::-1]
        eager_again = [decide(c, None) for c in cases]
        res["parity"] = {**compare(graph, eager, again, eager_again), "runner": runner.describe()}
        if args.records > 1:
            steps = [[record(rng.randint(1, 8), rng.choice([30, 120, 400, 417, 1000, 2000]))
                      for _ in range(rng.randint(2, args.records))] for _ in range(max(1, args.n // 4))]
            before = runner.describe()
            eager = [decide_step(s, None) for s in steps]
            graph = [decide_step(s, runner) for s in steps]
            again = [decide_step(s, runner) for s in reversed(steps)][::-1]
            eager_again = [decide_step(s, None) for s in steps]
            after = runner.describe()
            res["parity_several"] = {**compare(graph, eager, again, eager_again),
                                     "records": [len(s) for s in steps],
                                     "replays": after["replays"] - before["replays"],
                                     "fallbacks": after["fallbacks"], "runner": after}

        one = record(3, 400)

        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

        def timed(recs, graphs):
            sync()
            t0 = time.perf_counter()
            p = decide_step(recs, graphs)
            t1 = time.perf_counter()
            sync()
            return (t1 - t0) * 1000, (time.perf_counter() - t0) * 1000, p

        shapes = [("", [one])] + [(f"_{n}", [one] * n) for n in (16, 40) if args.records >= n]
        for suffix, recs in shapes:
            for graphs in (None, runner) * 5:
                timed(recs, graphs)
            for name, graphs in (("eager", None), ("graph", runner)):
                runs = [timed(recs, graphs) for _ in range(50)]
                res[f"time{suffix}_{name}"] = {"host_ms_p50": round(statistics.median(r[0] for r in runs), 3),
                                               "wall_ms_p50": round(statistics.median(r[1] for r in runs), 3)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "head_graphs.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    graphs = res["parity"]["runner"]
    ok = res["parity"]["finite"] and res["parity"]["top_flips"] == 0 and not graphs["failed"] and graphs["replays"] > 0
    if "parity_several" in res:
        several = res["parity_several"]
        ok = ok and several["finite"] and several["top_flips"] == 0 and several["replays"] > 0 \
            and not several["runner"]["failed"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
