"""``clef-sensitivity-scan``: which layers can take NVFP4? Per-layer, per-group quantization sensitivity of the decisions.

For every decoder layer and group — the mixer's projections (GDN in_proj_qkv / in_proj_z /
out_proj, or full-attention q/k/v/o) and the MLP (gate/up/down) — that group alone is put in
NVFP4 (fake-quant, fused shards sharing one global scale; everything else BF16) and the mean KL
divergence KL(BF16 || quantized) of the joint head's per-question answer distributions is
measured on held-out build_data records. The backbone, head and tables are the package's
reference backend (``clef_vllm.backends.reference`` + ``clef_vllm.model.features`` + ``clef_vllm.model.head``);
NVFP4/FP8 numerics are ``clef_vllm.quant``'s, identical to the exported checkpoints.

``--numerics w4a16`` (default) is what NVFP4 computes on Hopper (Marlin, weights only);
``w4a4`` also fake-quantizes activations with calibrated global scales (Blackwell).

Then, for every split K, the full Hybrid (layers < K FP8 W8A8, layers >= K NVFP4) is measured
too, next to the additive estimate from the per-layer scan; the suggested split is the smallest K
whose measured mean KL stays within ``--kl-budget``.

    clef-sensitivity-scan --model CKPT --data data/ --records 64
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from clef_vllm.quant.fake_quant import FakeQuant
from clef_vllm.util.atomic import write_json

GROUPS = ("attn", "mlp")
MIXER_LEAVES = {"linear_attn": ("in_proj_qkv", "in_proj_z", "out_proj"),
                "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj")}
MLP_LEAVES = ("gate_proj", "up_proj", "down_proj")


# --------------------------------------------------------------------------- fake quantization of an HF text model


def group_modules(model, layer: int, group: str) -> dict[str, torch.nn.Linear]:
    """``{name: Linear}`` of one group of one decoder layer of a ``Qwen3_5TextModel``."""
    dec = model.layers[layer]
    if group == "mlp":
        return {f"layers.{layer}.mlp.{n}": getattr(dec.mlp, n) for n in MLP_LEAVES}
    for parent, leaves in MIXER_LEAVES.items():
        if hasattr(dec, parent):
            return {f"layers.{layer}.{parent}.{n}": getattr(getattr(dec, parent), n) for n in leaves}
    raise ValueError(f"layer {layer}: no attention mixer found")


def layer_type(model, layer: int) -> str:
    return "GDN" if hasattr(model.layers[layer], "linear_attn") else "attention"


def apply_hybrid(fq: FakeQuant, model, split: int, numerics: str = "w4a16") -> None:
    """The Hybrid recipe as fake-quant: layers < split FP8 W8A8, layers >= split NVFP4."""
    for layer in range(len(model.layers)):
        modules = {**group_modules(model, layer, "attn"), **group_modules(model, layer, "mlp")}
        if layer < split:
            fq.fp8(modules)
        else:
            fq.nvfp4(modules, activations=numerics == "w4a4")


def calibrate_input_amax(backend, encoded) -> dict[str, float]:
    """Running max |input| of every covered Linear over ``encoded`` (for W4A4 global scales)."""
    amax: dict[str, float] = {}
    hooks = []
    for layer in range(len(backend.model.layers)):
        for group in GROUPS:
            for name, mod in group_modules(backend.model, layer, group).items():
                hooks.append(mod.register_forward_pre_hook(
                    lambda m, args, name=name: amax.__setitem__(name, max(amax.get(name, 0.0), float(args[0].abs().amax())))))
    try:
        with torch.inference_mode():
            for e in encoded:
                backend.hidden_states([e])
    finally:
        for h in hooks:
            h.remove()
    return amax


# --------------------------------------------------------------------------- decision metrics


def field_distributions(encoded, probs) -> list[torch.Tensor]:
    """Per-question probability vectors of a batch (fp64, encoded option order)."""
    out = []
    for e, p in zip(encoded, probs):
        out += list(p.double().split([len(f.option_spans) for f in e.fields]))
    return out


def compare(reference: list[torch.Tensor], other: list[torch.Tensor]) -> dict:
    """Mean KL(ref || other), mean total variation and top-answer agreement over questions."""
    kl, tv, agree = [], [], []
    for p, q in zip(reference, other):
        p, q = p.clamp_min(1e-12), q.clamp_min(1e-12)
        kl.append(float((p * (p / q).log()).sum()))
        tv.append(float(0.5 * (p - q).abs().sum()))
        agree.append(float(int(p.argmax()) == int(q.argmax())))
    n = max(len(kl), 1)
    return {"kl": sum(kl) / n, "tv": sum(tv) / n, "agreement": sum(agree) / n, "max_kl": max(kl, default=0.0),
            "questions": len(kl)}


def encode_records(encoder, records, max_length: int) -> tuple[list, list[dict]]:
    from clef_vllm.schema.dialects import parse_request
    from clef_vllm.schema.protocol import RequestError
    from clef_vllm.schema.records import request_body

    encoded, kept = [], []
    for r in records:
        try:
            encoded.append(encoder.encode(parse_request(request_body(r)), max_length=max_length))
            kept.append(r)
        except RequestError:
            continue
    return encoded, kept


# --------------------------------------------------------------------------- the scan


def scan(model_dir: Path, data, records: int, device: str, numerics: str, max_length: int, calib_records: int,
         measure_splits: bool = True, progress: bool = True) -> dict:
    from tqdm import tqdm

    from clef_vllm.backends.reference import ReferenceBackend
    from clef_vllm.schema.records import read_records
    from clef_vllm.tools.build_data import synthetic_records

    t0 = time.perf_counter()
    backend = ReferenceBackend(model_dir, device=device, dtype="bfloat16", max_model_len=max_length,
                               max_batch_size=16)
    held = read_records(data, split="heldout", limit=records) if data else list(synthetic_records(records, seed=1))
    encoded, kept = encode_records(backend.encoder, held, max_length)
    if not encoded:
        raise SystemExit("no held-out record fits --max-length")
    input_amax = {}
    if numerics == "w4a4":
        train = read_records(data, limit=calib_records) if data else list(synthetic_records(calib_records, seed=2))
        input_amax = calibrate_input_amax(backend, encode_records(backend.encoder, train, max_length)[0])

    def decide():
        with torch.inference_mode():
            return field_distributions(encoded, backend.decide_batch(encoded))

    reference = decide()
    model = backend.model
    n_layers = len(model.layers)
    entries = []
    steps = n_layers * len(GROUPS) + (n_layers + 1 if measure_splits else 0)
    bar = tqdm(total=steps, desc="sensitivity", unit="run", file=sys.stderr, disable=not progress)
    for layer in range(n_layers):
        for group in GROUPS:
            with FakeQuant(input_amax) as fq:
                fq.nvfp4(group_modules(model, layer, group), activations=numerics == "w4a4")
                metrics = compare(reference, decide())
            entries.append({"layer": layer, "type": layer_type(model, layer), "group": group, **metrics})
            bar.update()
    splits = []
    per_layer = [sum(e["kl"] for e in entries if e["layer"] == i) for i in range(n_layers)]
    fp8_only = None
    if measure_splits:
        for k in range(n_layers + 1):
            with FakeQuant(input_amax) as fq:
                apply_hybrid(fq, model, k, numerics)
                metrics = compare(reference, decide())
            splits.append({"split": k, "nvfp4_layers": n_layers - k, "estimate_kl": sum(per_layer[k:]), **metrics})
            bar.update()
        fp8_only = splits[-1]["kl"]
    else:
        splits = [{"split": k, "nvfp4_layers": n_layers - k, "estimate_kl": sum(per_layer[k:])} for k in range(n_layers + 1)]
    bar.close()
    return {"model": str(model_dir), "numerics": numerics, "records": len(encoded),
            "questions": len(reference), "layers": n_layers, "device": device, "entries": entries, "splits": splits,
            "fp8_only_kl": fp8_only, "seconds": time.perf_counter() - t0,
            "sources": sorted({r["source"].split("/")[0] for r in kept})}


def suggest_split(result: dict, kl_budget: float | None) -> tuple[int, float]:
    """Smallest K whose (measured, else estimated) Hybrid KL is within the budget; the budget
    defaults to twice the all-FP8 KL (or 10 % of the all-NVFP4 estimate without measurements)."""
    key = "kl" if "kl" in result["splits"][0] else "estimate_kl"
    if kl_budget is None:
        kl_budget = 2 * result["fp8_only_kl"] if result.get("fp8_only_kl") else 0.1 * result["splits"][0][key]
        kl_budget = max(kl_budget, 1e-9)
    for s in result["splits"]:
        if s[key] <= kl_budget:
            return s["split"], kl_budget
    return result["layers"], kl_budget


def plot(result: dict, path: Path, suggested: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = result["layers"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6, 0.35 * n + 3), 7), constrained_layout=True)
    width = 0.4
    for j, group in enumerate(GROUPS):
        vals = [next(e["kl"] for e in result["entries"] if e["layer"] == i and e["group"] == group) for i in range(n)]
        ax1.bar([i + (j - 0.5) * width for i in range(n)], [max(v, 1e-9) for v in vals], width,
                label="mixer projections (GDN / attention)" if group == "attn" else "MLP")
    ax1.set_yscale("log")
    ax1.set_xlabel("decoder layer")
    ax1.set_ylabel("mean KL vs BF16 (nats)")
    ax1.set_title(f"one group in NVFP4 ({result['numerics']}), rest BF16; {result['questions']} questions "
                  f"(* = full attention)", fontsize=9)
    ax1.set_xticks(range(n))
    ax1.set_xticklabels([f"{i}{'*' if next(e['type'] for e in result['entries'] if e['layer'] == i) == 'attention' else ''}"
                         for i in range(n)], fontsize=7)
    ax1.legend(fontsize=8)
    ks = [s["split"] for s in result["splits"]]
    ax2.plot(ks, [max(s["estimate_kl"], 1e-9) for s in result["splits"]], "o--", label="sum of per-layer KLs (layers >= K)")
    if "kl" in result["splits"][0]:
        ax2.plot(ks, [max(s["kl"], 1e-9) for s in result["splits"]], "s-", label="measured Hybrid (FP8 < K, NVFP4 >= K)")
    ax2.axvline(suggested, color="gray", linestyle=":", label=f"suggested K = {suggested}")
    ax2.set_yscale("log")
    ax2.set_xlabel("split K")
    ax2.set_xticks(ks)
    ax2.set_ylabel("mean KL vs BF16 (nats)")
    ax2.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="clef-sensitivity-scan", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="BF16 Clef checkpoint (release or repacked layout)")
    ap.add_argument("--data", help="build_data folder (heldout.jsonl for evaluation, train.jsonl for calibration)")
    ap.add_argument("--records", type=int, default=64, help="held-out records to evaluate")
    ap.add_argument("--calibration-records", type=int, default=16, help="train records for W4A4 activation scales")
    ap.add_argument("--numerics", choices=("w4a16", "w4a4"), default="w4a16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--kl-budget", type=float, help="mean KL allowed for the suggested split (default: 2x the all-FP8 KL)")
    ap.add_argument("--no-measure-splits", action="store_true", help="only the additive estimate per split")
    ap.add_argument("--json", type=Path, default=Path("sensitivity_scan.json"),
                    help="result JSON (default: ./sensitivity_scan.json; the plot goes next to it)")
    ap.add_argument("--plot", type=Path, help="PNG path (default: next to --json)")
    a = ap.parse_args(argv)
    from clef_vllm.model.checkpoint import CheckpointError

    try:                               # the plot comes last: say what is missing before the scan's minutes
        import matplotlib  # noqa: F401
    except ImportError:
        ap.error("the plot needs matplotlib, which this environment lacks: pip install -r requirements/scripts.txt "
                 "(or pip install 'matplotlib>=3.8')")
    try:
        result = scan(a.model, a.data, a.records, a.device, a.numerics, a.max_length, a.calibration_records,
                      not a.no_measure_splits)
    except CheckpointError as exc:
        ap.error(f"--model {exc}")
    k, budget = suggest_split(result, a.kl_budget)
    result["suggested_split"], result["kl_budget"] = k, budget
    write_json(a.json, result)
    png = a.plot or a.json.with_suffix(".png")
    plot(result, png, k)
    print(f"{result['records']} held-out records, {result['questions']} questions, {result['layers']} layers, "
          f"NVFP4 {a.numerics}, {result['seconds']:.1f} s")
    print(" layer type       attn KL     MLP KL")
    for i in range(result["layers"]):
        row = {e["group"]: e for e in result["entries"] if e["layer"] == i}
        print(f"  {i:3d} {row['attn']['type']:9s} {row['attn']['kl']:10.2e} {row['mlp']['kl']:10.2e}")
    print("cumulative damage (layers >= K in NVFP4):")
    print("    K  estimate KL" + ("  measured Hybrid KL  TV      agreement" if "kl" in result["splits"][0] else ""))
    for s in result["splits"]:
        line = f"  {s['split']:3d}  {s['estimate_kl']:11.2e}"
        if "kl" in s:
            line += f"  {s['kl']:18.2e}  {s['tv']:.4f}  {s['agreement']:.3f}"
        print(line)
    print(f"suggested split: K = {k} (mean KL within {budget:.2e}); wrote {a.json} and {png}")
    if not math.isfinite(result["splits"][0].get("kl", 0.0)):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
