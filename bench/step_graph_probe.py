"""GPU probe: can one CUDA graph hold the whole backbone of a single-sequence prefill step?

The step's host work is what bounds one short decision (docs/latency.md), and the host's speed is a
lottery on the shared machines. A graph per bucket for the whole backbone would leave one launch per
step. vLLM 0.28 gives a pooling model no full graphs, so the plugin owns it (``--prefill-graph-scope step``).
This probe answers the questions that decide the design, in process (``vllm.LLM``, the server's
engine settings, one request at a time), before that option is trusted:

1. **survey**: for several single-sequence prefill steps padded to the same token count, the address
   of every tensor the backbone reads from outside the model (token ids, positions, each layer
   group's attention metadata and slot mapping) and the scalars (lengths). A tensor whose address is
   the same in every step can be read by a graph as it is; one that moves has to be copied into a
   static buffer before each replay; a scalar that varies with the length has to be baked per bucket.
2. **capture** (skipped with ``--survey-only``), in three flavours, each over the same lengths: at the
   first eligible step of a padded size, capture the backbone's forward (vLLM's piecewise wrappers
   passing through, the GDN layers running their bucket bodies inline: ``GdnGraphRunner.inline``);
   for later steps of that size run the normal forward AND the replay, and compare the real rows'
   hidden states (max |diff|, exact or not) and the time each takes (host time to return, wall time
   to the result).

   - ``static`` (the design to test, ``clef_vllm.worker.fast.step_graphs.StepGraph``, what
     ``--prefill-graph-scope step`` runs; first): the graph reads static copies of the token ids,
     positions, FA3 metadata tensors and slot mappings, refreshed from each step before its replay;
     FA3's metadata is captured for the padded size (every padded row, the longest query, the
     model's longest sequence, no ahead-of-time schedule); the GDN state line and flag come from
     static per-group sources, and the GDN metadata is captured for the padded size too; the
     padding mask is set outside the graph. Every replay should be exact at any real length of the
     size.
   - ``fresh``: ``static`` with the padded size as FA3's longest sequence instead of the model's
     (valid for steps without context, as here; what ``--prefill-graph-scope step`` now runs for
     such steps, while ``static`` is what it runs for steps with context): whether that length is
     what made ``static`` ~1 ms slower than ``direct`` when it was measured, and whether it
     changes exactness.
   - ``direct``: the graph reads the tensors of the step it was captured in, as they are; it can be
     right only where the survey finds every input at a fixed address (and may break the engine
     otherwise: it runs last).

A failed or wrong replay is an answer too: the survey says which inputs moved. Results:
``$OUT/step_graph_probe.json`` (written after the survey, again after the capture part).

    python3 bench/step_graph_probe.py --out $OUT [--ckpt DIR] [--quantization fp8] [--survey-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

LENGTHS = (400, 410, 431, 400, 445, 392, 420, 400)     # one bucket (448), varied real lengths
OTHER = (300, 310)                                      # another bucket (320)
FLAVOURS = ("static", "fresh", "direct")                # the graph designs compared (graph_classes)


def scalars_and_tensors(obj, prefix: str = "") -> tuple[dict, dict]:
    """Tensor fields (name -> data_ptr, shape) and scalar fields (name -> value) of a metadata object,
    one level into dicts and plain objects."""
    import torch

    tensors, scalars = {}, {}
    items = vars(obj).items() if hasattr(obj, "__dict__") else (
        [(f, getattr(obj, f)) for f in getattr(obj, "__dataclass_fields__", {})])
    for name, value in items:
        key = prefix + name
        if isinstance(value, torch.Tensor):
            tensors[key] = (value.data_ptr(), list(value.shape))
        elif isinstance(value, (int, float, bool)) or value is None:
            scalars[key] = value
        elif isinstance(value, dict) and not prefix:
            for k, v in value.items():
                if isinstance(v, torch.Tensor):
                    tensors[f"{key}.{k}"] = (v.data_ptr(), list(v.shape))
                elif isinstance(v, (int, float, bool)):
                    scalars[f"{key}.{k}"] = v
        elif hasattr(value, "__dict__") and not prefix and not callable(value):
            t, s = scalars_and_tensors(value, key + ".")
            tensors.update(t)
            scalars.update(s)
    return tensors, scalars


def survey_step(ctx, input_ids, positions) -> dict:
    """One step's outside inputs: per metadata object (a layer group), its tensors and scalars."""
    groups, seen = [], {}
    md_all = ctx.attn_metadata if isinstance(ctx.attn_metadata, dict) else {}
    for layer, md in md_all.items():
        if id(md) in seen:
            groups[seen[id(md)]]["layers"] += 1
            continue
        seen[id(md)] = len(groups)
        tensors, scalars = scalars_and_tensors(md)
        groups.append({"kind": type(md).__name__, "first_layer": layer, "layers": 1,
                       "tensors": tensors, "scalars": scalars})
    slots = ctx.slot_mapping if isinstance(getattr(ctx, "slot_mapping", None), dict) else {}
    return {"tokens": int(input_ids.shape[0]) if input_ids is not None else None,
            "input_ids": input_ids.data_ptr() if input_ids is not None else None,
            "positions": (positions.data_ptr(), list(positions.shape)),
            "slot_mapping": sorted({(t.data_ptr(), tuple(t.shape)) for t in slots.values()}),
            "groups": groups}


def summarize_survey(steps: list[dict]) -> dict:
    """Per (group kind, first layer, field): does the address stay put across steps of one padded size?
    Which scalars vary?"""
    by_size: dict[int, list[dict]] = {}
    for s in steps:
        by_size.setdefault(s["tokens"], []).append(s)
    out = {}
    for size, group in by_size.items():
        if len(group) < 2:
            continue
        moved, stable, varying = set(), set(), {}
        for key in ("input_ids", "positions", "slot_mapping"):
            (stable if len({json.dumps(s[key]) for s in group}) == 1 else moved).add(key)
        for gi, g0 in enumerate(group[0]["groups"]):
            tag = f"{g0['kind']}[{g0['first_layer']}]"
            for field in g0["tensors"]:
                ptrs = {json.dumps(s["groups"][gi]["tensors"].get(field)) for s in group if gi < len(s["groups"])}
                (stable if len(ptrs) == 1 else moved).add(f"{tag}.{field}")
            for field in g0["scalars"]:
                values = [s["groups"][gi]["scalars"].get(field) for s in group if gi < len(s["groups"])]
                if len(set(map(json.dumps, values))) > 1:
                    varying[f"{tag}.{field}"] = values
        out[str(size)] = {"steps": len(group), "moved": sorted(moved), "stable": sorted(stable),
                          "varying_scalars": varying}
    return out


def graph_classes():
    """The design under test (:class:`clef_vllm.worker.fast.step_graphs.StepGraph`, flavour ``static``) and the
    naive capture (``direct``)."""
    from clef_vllm.worker.fast.step_graphs import StepGraph

    class DirectGraph(StepGraph):
        """The step's own tensors, as captured: no static copies, nothing refreshed but the GDN mask."""

        def statics(self, ctx, input_ids, positions):
            self.ids, self.pos = input_ids, positions
            return ctx.attn_metadata, ctx.slot_mapping

        def feed(self, ctx, input_ids, positions, n):
            self._bucket(n).set_length(n)

    class FreshGraph(StepGraph):
        """``static`` with FA3 captured for the padded size as the longest sequence, not the model's: valid
        only for steps without context (every step the probe replays). FA3 sizes its work (and picks
        its split count) from that length: does the model's longest cost the ~1 ms by which ``direct``
        replays beat ``static``?"""

        def statics(self, ctx, input_ids, positions):
            self.max_len = int(input_ids.shape[0])
            return super().statics(ctx, input_ids, positions)

    return {"static": StepGraph, "fresh": FreshGraph, "direct": DirectGraph}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    ap.add_argument("--ckpt", type=Path, default=None, help="default: a generated 9B-shaped config folder")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--survey-only", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"        # the engine core (and the model) in this process

    import torch
    from latency import engine_settings        # bench/latency.py: the server's settings, mode "graphs"
    from vllm import LLM, TokensPrompt
    from vllm.config import CUDAGraphMode, PoolerConfig
    from vllm.forward_context import get_forward_context

    from clef_vllm import register
    from clef_vllm.backends.vllm_backend import pooling_params
    from clef_vllm.model.features import synthetic_spec
    from clef_vllm.worker.fast.prefill_graphs import fallback_reason

    register()
    ckpt = args.ckpt
    if ckpt is None:
        from clef_vllm.model.release import write_config_only_checkpoint

        ckpt = Path(tempfile.mkdtemp()) / "clef-9b"
        write_config_only_checkpoint(ckpt, layout="repacked")
    kw = engine_settings("graphs", ckpt, args.quantization)
    if isinstance(kw.get("pooler_config"), dict):
        kw["pooler_config"] = PoolerConfig(**kw["pooler_config"])
    llm = LLM(**kw)
    report: dict = {"ckpt": str(ckpt), "quantization": args.quantization, "lengths": LENGTHS + OTHER}

    def save():
        (args.out / "step_graph_probe.json").write_text(json.dumps(report, indent=1, default=str) + "\n")

    def decide(n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(10, 1000, (n,), generator=g).tolist()
        llm.encode([TokensPrompt(prompt_token_ids=ids)], pooling_params=[pooling_params(synthetic_spec(n))],
                   pooling_task="plugin", use_tqdm=False)

    state: dict = {"mode": "survey", "steps": [], "graphs": {}, "compare": [], "errors": []}
    classes = graph_classes()
    max_len = kw.get("max_model_len", 16384)

    def install(worker):
        model = worker.model_runner.model
        runner = model.prefill_graphs
        original = model.forward

        def eligible(ctx):
            md_all = ctx.attn_metadata if isinstance(ctx.attn_metadata, dict) else {}
            gdn = next((m for m in md_all.values() if type(m).__name__ == "GDNAttentionMetadata"), None)
            if gdn is None or runner is None:
                return None
            return None if fallback_reason(gdn, runner.buckets, runner.min_tokens) else gdn.num_actual_tokens

        def forward(input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kw):
            ctx = get_forward_context()
            n = eligible(ctx)
            if n is None or state["mode"] == "off":
                return original(input_ids, positions, intermediate_tensors, inputs_embeds, **kw)
            if state["mode"] == "survey":
                step = survey_step(ctx, input_ids, positions)
                step["real_tokens"] = n
                state["steps"].append(step)
                return original(input_ids, positions, intermediate_tensors, inputs_embeds, **kw)
            size = int(input_ids.shape[0])
            key = (state["mode"], size)
            entry = state["graphs"].get(key)
            if entry is None:
                entry = state["graphs"][key] = classes[state["mode"]](runner, max_len)
                try:
                    entry.capture(ctx, input_ids, positions, n, lambda i, p: original(i, p), None, CUDAGraphMode.NONE)
                except Exception as exc:  # noqa: BLE001 - the probe reports it
                    state["errors"].append(f"{key} capture: {type(exc).__name__}: {exc}"[:800])
                    entry.graph = None
                return original(input_ids, positions, intermediate_tensors, inputs_embeds, **kw)
            if entry.graph is None:
                return original(input_ids, positions, intermediate_tensors, inputs_embeds, **kw)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ref = original(input_ids, positions, intermediate_tensors, inputs_embeds, **kw)
            host_ref = time.perf_counter() - t0
            torch.cuda.synchronize()
            wall_ref = time.perf_counter() - t0
            ref = ref.clone()
            try:
                t0 = time.perf_counter()
                out = entry.replay(ctx, input_ids, positions, n)
                host_rep = time.perf_counter() - t0
                torch.cuda.synchronize()
                wall_rep = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001
                state["errors"].append(f"{key} replay at {n}: {type(exc).__name__}: {exc}"[:800])
                return ref
            diff = (out[:n].float() - ref[:n].float()).abs()
            state["compare"].append({"flavour": state["mode"], "tokens": size, "real": n,
                                     "captured_at": entry.captured_at, "max_abs_diff": float(diff.max()),
                                     "exact": bool(torch.equal(out[:n], ref[:n])),
                                     "host_ms": [round(host_ref * 1e3, 3), round(host_rep * 1e3, 3)],
                                     "wall_ms": [round(wall_ref * 1e3, 3), round(wall_rep * 1e3, 3)]})
            return ref

        model.forward = forward
        return runner is not None

    if not llm.collective_rpc(install)[0]:
        report["error"] = "prefill graphs are off: nothing to probe"
        save()
        return 1
    for i, n in enumerate(LENGTHS + OTHER):     # warm-up: every kernel and GDN graph of both buckets
        decide(n, 100 + i)
    state["steps"].clear()
    for i, n in enumerate(LENGTHS + OTHER):
        decide(n, 200 + i)
    report["survey"] = summarize_survey(state["steps"])
    report["survey_steps"] = state["steps"][:3]
    save()
    print(json.dumps(report["survey"], indent=1), flush=True)
    if args.survey_only:
        return 0
    for flavour, seed in (("static", 300), ("fresh", 500), ("direct", 400)):   # direct last: it may break the engine
        state["mode"] = flavour
        for i, n in enumerate(LENGTHS + OTHER):
            try:
                decide(n, seed + i)
            except Exception as exc:  # noqa: BLE001 - a broken replay may take the engine down: report what we have
                state["errors"].append(f"{flavour} decision {n}: {type(exc).__name__}: {exc}"[:800])
                break
        else:
            continue
        break
    state["mode"] = "off"
    comp = state["compare"]

    def medians(flavour: str, field: str, i: int):
        values = [c[field][i] for c in comp if c["flavour"] == flavour]
        return round(statistics.median(values), 3) if values else None

    report["capture"] = {
        "graphs": {f"{k[0]}@{k[1]}": {"captured_at": v.captured_at, "capture_s": v.capture_s, "ok": v.graph is not None}
                   for k, v in state["graphs"].items()},
        "compare": comp,
        "errors": state["errors"],
        "median_host_ms": {f: [medians(f, "host_ms", 0), medians(f, "host_ms", 1)] for f in FLAVOURS},
        "median_wall_ms": {f: [medians(f, "wall_ms", 0), medians(f, "wall_ms", 1)] for f in FLAVOURS},
    }
    save()
    print(json.dumps(report["capture"], indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
