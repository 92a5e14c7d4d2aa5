"""GPU probe: can one CUDA graph hold the whole backbone of a single-sequence prefill step?

The step's host work is what bounds one short decision (docs/latency.md), and the host's speed is a
lottery on the shared machines. A graph per bucket for the whole backbone would leave one launch per
step. vLLM 0.28 gives a pooling model no full graphs, so the plugin would own it, like the GDN graphs.
This probe answers the questions that decide the design, in process (``vllm.LLM``, the server's
engine settings, one request at a time), before any of it is built:

1. **survey**: for several single-sequence prefill steps padded to the same token count, the address
   of every tensor the backbone reads from outside the model (token ids, positions, each layer
   group's attention metadata and slot mapping) and the scalars (lengths). A tensor whose address is
   the same in every step can be read by a graph as it is; one that moves has to be copied into a
   static buffer before each replay; a scalar that varies with the length has to be baked per bucket.
2. **capture** (skipped with ``--survey-only``), in two flavours, each over the same lengths: at the
   first eligible step of a padded size, capture the backbone's forward (vLLM's piecewise wrappers
   passing through, the GDN layers running their bucket bodies inline: ``GdnGraphRunner.inline``);
   for later steps of that size run the normal forward AND the replay, and compare the real rows'
   hidden states (max |diff|, exact or not) and the time each takes (host time to return, wall time
   to the result).

   - ``static`` (the design to test; first): the graph reads static copies of the token ids,
     positions, FA3 metadata tensors and slot mappings, refreshed from each step before its replay;
     FA3's metadata is captured for the padded size (every padded row, the longest query, the
     model's longest sequence, no ahead-of-time schedule); the GDN state line and flag come from
     static per-group sources; the padding mask is set outside the graph. Every replay should be
     exact at any real length of the size.
   - ``direct``: the graph reads the tensors of the step it was captured in, as they are; it can be
     right only where the survey finds every input at a fixed address (and may break the engine
     otherwise: it runs second).

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
from typing import Any

LENGTHS = (400, 410, 431, 400, 445, 392, 420, 400)     # one bucket (448), varied real lengths
OTHER = (300, 310)                                      # another bucket (320)


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


class StepGraph:
    """One captured backbone forward for one padded token count.

    ``direct``: the graph reads the tensors of the step it was captured in (token ids, positions,
    attention metadata, slot mappings), as they are; only steps whose inputs keep their addresses
    replay correctly. ``static`` (the design to test): it reads static copies, refreshed from the
    step's own tensors before each replay. The FA3 metadata is captured for the bucket (every padded
    row, the longest query, the model's longest sequence, no ahead-of-time schedule); the GDN layers
    run their bucket bodies inline with their state line and flag from static per-group sources
    (``GdnGraphRunner.inline_sources``); the padding mask is set outside the graph.
    """

    def __init__(self, flavour: str, runner, original, max_len: int):
        self.flavour, self.runner, self.original, self.max_len = flavour, runner, original, max_len
        self.graph = None
        self.out = None
        self.captured_at = None
        self.capture_s = None
        self.ids = self.pos = None
        self.attn: dict[str, Any] = {}        # first layer of a FA3 group -> its static metadata
        self.slots: dict[str, Any] = {}       # layer -> static slot mapping
        self.gdn: dict[str, tuple] = {}       # first layer of a GDN group -> (static line, static flag)

    @staticmethod
    def _static_slots(t, rows: int):
        """A static copy of a slot mapping, as long as the padded step (-1, no write, after the real rows)."""
        import torch

        if t.dim() == 1 and t.shape[0] < rows and not t.is_floating_point():
            out = torch.full((rows,), -1, dtype=t.dtype, device=t.device)
            out[:t.shape[0]].copy_(t)
            return out
        return t.clone()

    @staticmethod
    def _refresh(static, t) -> None:
        if static.shape == t.shape:
            static.copy_(t)
        else:                                   # a shorter slot mapping: -1 for the padded rows
            static.fill_(-1)
            static[:t.shape[0]].copy_(t)

    @staticmethod
    def _groups(md_all: dict, kind: str) -> dict[str, Any]:
        """First layer name -> metadata object, for the groups of one metadata kind."""
        out, seen = {}, set()
        for layer, md in md_all.items():
            if type(md).__name__ == kind and id(md) not in seen:
                seen.add(id(md))
                out[layer] = md
        return out

    def _bucket(self, n: int):
        from clef_vllm.worker.prefill_graphs import choose_bucket

        return self.runner._buckets[choose_bucket(n, self.runner.buckets)]

    def capture(self, ctx, input_ids, positions, n: int) -> None:
        import dataclasses

        import torch
        from vllm.config import CUDAGraphMode

        size = int(input_ids.shape[0])
        saved = (ctx.attn_metadata, ctx.slot_mapping, ctx.cudagraph_runtime_mode)
        ids, pos = input_ids, positions
        try:
            if self.flavour == "static":
                ids, pos = self.ids, self.pos = input_ids.clone(), positions.clone()
                md_all = dict(ctx.attn_metadata)
                layer_group = {}
                for first, md in self._groups(md_all, "FlashAttentionMetadata").items():
                    static = dataclasses.replace(
                        md, num_actual_tokens=size, max_query_len=size, max_seq_len=self.max_len,
                        query_start_loc=md.query_start_loc.clone(), seq_lens=md.seq_lens.clone(),
                        block_table=md.block_table.clone(), slot_mapping=self._static_slots(md.slot_mapping, size),
                        scheduler_metadata=None)
                    self.attn[first] = static
                    layer_group[id(md)] = static
                md_all = {layer: layer_group.get(id(md), md) for layer, md in md_all.items()}
                slots = {}
                for layer, t in (ctx.slot_mapping or {}).items():
                    slots[layer] = self.slots[layer] = self._static_slots(t, size)
                for first, md in self._groups(md_all, "GDNAttentionMetadata").items():
                    src = (md.prefill_state_indices[:1].clone(), md.prefill_has_initial_state[:1].clone())
                    self.gdn[first] = src
                    self.runner.inline_sources[id(md)] = src
                ctx.attn_metadata, ctx.slot_mapping = md_all, slots
            ctx.cudagraph_runtime_mode = CUDAGraphMode.NONE
            self.runner.inline = True
            self._bucket(n).set_length(n)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.original(ids, pos)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            t0 = time.perf_counter()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.out = self.original(ids, pos)
            torch.cuda.synchronize()
            self.graph, self.captured_at, self.capture_s = graph, n, round(time.perf_counter() - t0, 3)
        finally:
            ctx.attn_metadata, ctx.slot_mapping, ctx.cudagraph_runtime_mode = saved
            self.runner.inline = False
            self.runner.inline_sources.clear()
            self._forget()

    def _forget(self) -> None:
        """The buckets' Python-side caches no longer describe their buffers: make the next step set them."""
        for bucket in self.runner._buckets.values():
            bucket.length = None
            bucket.fed = None

    def replay(self, ctx, input_ids, positions, n: int):
        if self.flavour == "static":
            self.ids.copy_(input_ids)
            self.pos.copy_(positions)
            for first, static in self.attn.items():
                md = ctx.attn_metadata[first]
                for field in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
                    self._refresh(getattr(static, field), getattr(md, field))
            for layer, t in self.slots.items():
                self._refresh(t, ctx.slot_mapping[layer])
            for first, (line, init) in self.gdn.items():
                md = ctx.attn_metadata[first]
                line.copy_(md.prefill_state_indices[:1])
                init.copy_(md.prefill_has_initial_state[:1])
        self._bucket(n).set_length(n)
        self.graph.replay()
        self._forget()
        return self.out


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
    from vllm.config import PoolerConfig
    from vllm.forward_context import get_forward_context

    from clef_vllm import register
    from clef_vllm.backends.vllm_backend import pooling_params
    from clef_vllm.features import synthetic_spec
    from clef_vllm.worker.prefill_graphs import fallback_reason

    register()
    ckpt = args.ckpt
    if ckpt is None:
        from clef_vllm.release import write_config_only_checkpoint

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
                entry = state["graphs"][key] = StepGraph(state["mode"], runner, original, max_len)
                try:
                    entry.capture(ctx, input_ids, positions, n)
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
    for flavour, seed in (("static", 300), ("direct", 400)):     # static first: a direct replay may break the engine
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
        "median_host_ms": {f: [medians(f, "host_ms", 0), medians(f, "host_ms", 1)] for f in ("static", "direct")},
        "median_wall_ms": {f: [medians(f, "wall_ms", 0), medians(f, "wall_ms", 1)] for f in ("static", "direct")},
    }
    save()
    print(json.dumps(report["capture"], indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
