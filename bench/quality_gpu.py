#!/usr/bin/env python3
"""Hybrid quantization quality on a trained Clef-architecture proxy, in one GPU call.

The tiny random checkpoint says nothing about quality, so this trains a small proxy with the real
architecture: a ~9 M-parameter Qwen3.5 backbone (8 layers: 6 GDN + 2 full
attention, hidden 256) plus the package's ``JointSchemaHead``, first as a language model on the
encoded prompts, then jointly on the decisions of build_data's train split. Then:

1. **build** — BF16 proxy in the release layout; Hybrid builds for K in {0, L/2, L} with the
   native exporter (``clef-quantize-mixed --engine native``; llm-compressor is not on the
   GPU image and gives bit-identical weights, tests/test_scripts.py); every build repacked by
   ``shrink_tables`` and checked by ``clef_load``.
2. **scan** — ``clef-sensitivity-scan`` on the BF16 proxy (W4A16, what Hopper runs).
3. **simulate** — the reference backend with fake-quant (W8A8 + W4A16 and W8A8 + W4A4) against
   BF16, next to a reference BF16-vs-BF16 noise floor (batch size 16 vs 1).
4. **vllm** — every build served through the plugin, ``Clef(dir, backend="vllm")``, one engine
   process per build: top-answer agreement, KL and TV against vLLM BF16, next to a vLLM
   BF16-vs-BF16 noise floor (same requests, reversed order in chunks of 7: different batches).

Everything lands in ``--out`` (quality.json, quality.md, sensitivity_scan.{json,png}, logs) as
soon as it is measured; a stage that fails is recorded and the others still run.

    bash bench/quality_gpu.sh                                # on the H200, after vLLM staging
    python bench/quality_gpu.py all --device cpu --small --stages train,build,scan,simulate  # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

STAGES = ("train", "build", "scan", "simulate", "vllm")
MAX_LEN = 1024   # prompt tokens, everywhere (training, calibration, evaluation)


# --------------------------------------------------------------------------- small helpers


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Results:
    """quality.json, rewritten after every measurement, in --out and in --work (so a second call on
    the same warm machine, whose $OUT starts empty, carries the first call's results on)."""

    def __init__(self, out: Path, work: Path | None = None):
        self.out = out
        self.paths = [out / "quality.json"] + ([work / "quality.json"] if work is not None else [])
        existing = next((p for p in self.paths if p.is_file()), None)
        self.data = json.loads(existing.read_text()) if existing else {}

    def set(self, key: str, value) -> None:
        self.data[key] = value
        for path in self.paths:
            path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")


def environment() -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0],
           "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "capability": list(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None}
    from importlib import metadata

    for name, dist in (("vllm", "vllm"), ("compressed_tensors", "compressed-tensors"), ("fla", "fla-core")):
        try:
            env[name] = metadata.version(dist)     # no import: importing vllm costs ~17 s
        except metadata.PackageNotFoundError:
            env[name] = "not installed"
    return env


# --------------------------------------------------------------------------- data and tokenizer


def load_data(data: str | None, work: Path, small: bool) -> Path:
    """build_data's folder: the carried one, or synthetic records generated here."""
    from clef_vllm.tools.build_data import build

    if data:
        return Path(data)
    folder = work / "data"
    if not (folder / "train.jsonl").is_file():
        build(["synthetic"], folder, work / "cache", 600 if small else 8000, None, 10.0, 4000, 0)
    return folder


def prompt_texts(records) -> list[str]:
    """The texts the encoder tokenizes, for training the proxy's BPE."""
    from clef_vllm.schema import encoding as E
    from clef_vllm.schema.dialects import parse_request
    from clef_vllm.schema.records import request_body

    texts = [E.PREFIX_TEXT, E.SCHEMA_HEADER_TEXT, E.OPTIONS_HEADER_TEXT, E.FIELD_END_TEXT, E.SUFFIX_TEXT] * 20
    for r in records:
        req = parse_request(request_body(r))
        texts.append(E.render(req.state))
        for k, (qid, q) in enumerate(req.questions.items(), start=1):
            texts.append(f"\nFIELD {k}\nID: {qid}\nTYPE: {q.type}\nINSTRUCTION: ")
            texts.append(E.instruction_text(qid, q.instructions))
            texts += [E.render_option(o, d) for o, d in E.question_options(q)]
            texts += [f"OPTION {j}: " for j in range(1, 6)]
    return texts


def train_tokenizer(texts: list[str], vocab: int, out: Path):
    """Byte-level BPE with Qwen3.5's split regex and special tokens (as the tiny checkpoints)."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    from clef_vllm.model.tiny import CHAT_TEMPLATE, QWEN_SPLIT, SPECIAL_TOKENS

    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=vocab - len(SPECIAL_TOKENS), min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(SPECIAL_TOKENS)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 unk_token=None, model_max_length=262144)
    hf.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return hf


# --------------------------------------------------------------------------- the proxy


def proxy_configs(tok, small: bool):
    """(VL Qwen3_5Config, HeadConfig): hidden 256, 8 layers (6 GDN + 2 full), every dim a multiple of 64."""
    from transformers import Qwen3_5Config

    from clef_vllm.model.head import HeadConfig
    from clef_vllm.model.tiny import SPECIAL_TOKENS, tiny_text_config

    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    hidden, layers = (128, 4) if small else (256, 8)
    text = tiny_text_config(ids, (len(tok) + 63) // 64 * 64, hidden, layers)
    text.update(max_position_embeddings=262144)
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=hidden, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64, in_channels=3,
                  deepstack_visual_indexes=[])
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False,
                        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    head = HeadConfig(hidden_size=hidden, width=128 if not small else 64, routing_layers=2, layers=2, heads=4,
                      feedforward=256 if not small else 128)
    return cfg, head


def answer_targets(record: dict, encoded) -> list[int]:
    """Index of the correct option inside each field's encoded option list."""
    return [f.option_ids.index(str(record["answer"][f.question_id])) for f in encoded.fields]


def batches(items, size: int, rng: random.Random):
    order = list(range(len(items)))
    while True:
        rng.shuffle(order)
        for i in range(0, len(order) - size + 1, size):
            yield [items[j] for j in order[i:i + size]]


def pad(seqs: list[list[int]], pad_id: int, device):
    longest = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), longest), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s)
        mask[b, :len(s)] = 1
    return ids.to(device), mask.to(device)


def decision_probs(model, head, lm_weight, batch_encoded, device):
    """Differentiable per-record option probabilities with the package's head path (fp32 training;
    the small proxy needs no autocast, and fp32 is the path the CPU smoke run exercises)."""
    from clef_vllm.model.features import HeadSpec, RecordAccumulator, accumulate, decide_records
    from clef_vllm.model.tables import DenseTable

    ids, mask = pad([e.input_ids for e in batch_encoded], 0, device)
    hidden = model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    accs = [RecordAccumulator(HeadSpec.from_encoded(e)) for e in batch_encoded]
    flat = hidden.float().reshape(-1, hidden.shape[-1])
    longest = hidden.shape[1]
    accumulate(head, flat, [(a, b * longest, a.spec.num_tokens, 0) for b, a in enumerate(accs)])
    return decide_records(head, DenseTable(lm_weight), accs)


def train_proxy(work: Path, data: Path, device: torch.device, small: bool, results: Results, seed: int = 0) -> Path:
    """Train tokenizer, backbone and head; save the BF16 proxy (release layout) under work/proxy-bf16."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5TextModel

    from clef_vllm.model.head import JointSchemaHead
    from clef_vllm.model.layout import VL_BACKBONE_PREFIX
    from clef_vllm.schema.dialects import parse_request
    from clef_vllm.schema.encoding import RequestEncoder
    from clef_vllm.schema.protocol import RequestError
    from clef_vllm.schema.records import read_records, request_body
    from clef_vllm.util.atomic import atomic_dir

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    rng = random.Random(seed)
    train = read_records(data)
    held = read_records(data, split="heldout")
    out = work / "proxy-bf16"
    with atomic_dir(out, replace=True) as staging:
        tok = train_tokenizer(prompt_texts(train), 1024 if small else 4096, staging)
        encoder = RequestEncoder(tok, max_length=MAX_LEN)
        examples = []
        for r in train:
            try:
                e = encoder.encode(parse_request(request_body(r)))
                examples.append((r, e, answer_targets(r, e)))
            except (RequestError, KeyError, ValueError):
                continue
        cfg, head_cfg = proxy_configs(tok, small)
        text_cfg = cfg.text_config
        text_cfg._attn_implementation = "sdpa"
        model = Qwen3_5TextModel(text_cfg).to(device)
        lm_head = torch.nn.Linear(text_cfg.hidden_size, text_cfg.vocab_size, bias=False).to(device)
        head = JointSchemaHead(head_cfg).to(device)
        params = sum(p.numel() for p in model.parameters()) + lm_head.weight.numel()
        log(f"proxy: {params / 1e6:.2f} M backbone parameters (+ lm_head), head {sum(p.numel() for p in head.parameters()) / 1e6:.2f} M, "
            f"{len(examples)} train records, tokenizer {len(tok)}")
        bs = 8 if small else 32
        lm_steps, dec_steps = (20, 40) if small else (int(os.environ.get("LM_STEPS", 300)), int(os.environ.get("DEC_STEPS", 900)))
        budget = float(os.environ.get("TRAIN_SECONDS", 60 if small else 180))
        history = {"lm": [], "decision": []}

        # phase A: language model on the encoded prompts
        opt = torch.optim.AdamW(list(model.parameters()) + list(lm_head.parameters()), lr=2e-3, weight_decay=0.01)
        it = batches(examples, bs, rng)
        model.train()
        for step in range(lm_steps):
            if time.perf_counter() - t0 > budget * 0.3:
                log(f"LM phase stopped by the time budget at step {step}")
                break
            batch = next(it)
            ids, mask = pad([e.input_ids for _, e, _ in batch], 0, device)
            hidden = model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            logits = lm_head(hidden[:, :-1]).float()
            target = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % 25 == 0 or step == lm_steps - 1:
                history["lm"].append((step, loss.item()))
                log(f"LM step {step}: loss {loss.item():.3f}")

        # phase B: decisions, head + backbone jointly (lm_head rows feed the head's lexical features)
        opt = torch.optim.AdamW([{"params": head.parameters(), "lr": 1e-3},
                                 {"params": list(model.parameters()) + list(lm_head.parameters()), "lr": 3e-4}],
                                weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[1e-3, 3e-4], total_steps=max(dec_steps, 2), pct_start=0.1)
        for step in range(dec_steps):
            if time.perf_counter() - t0 > budget:
                log(f"decision phase stopped by the time budget at step {step}")
                break
            batch = next(it)
            probs = decision_probs(model, head, lm_head.weight, [e for _, e, _ in batch], device)
            nll = []
            for (_, e, targets), p in zip(batch, probs):
                for field_probs, t in zip(p.split([len(f.option_spans) for f in e.fields]), targets):
                    nll.append(-torch.log(field_probs[t].clamp_min(1e-9)))
            loss = torch.stack(nll).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(head.parameters()), 1.0)
            opt.step()
            sched.step()
            if step % 50 == 0 or step == dec_steps - 1:
                history["decision"].append((step, loss.item()))
                log(f"decision step {step}: loss {loss.item():.3f}")
        model.eval()
        head.eval()

        # held-out accuracy of the proxy (fp32, as trained)
        correct, total = {}, {}
        with torch.no_grad():
            held_ex = []
            for r in held:
                try:
                    e = encoder.encode(parse_request(request_body(r)))
                    held_ex.append((r, e, answer_targets(r, e)))
                except (RequestError, KeyError, ValueError):
                    continue
            for i in range(0, len(held_ex), 32):
                chunk = held_ex[i:i + 32]
                for (r, e, targets), p in zip(chunk, decision_probs(model, head, lm_head.weight, [e for _, e, _ in chunk], device)):
                    src = "/".join(r["source"].split("/")[:2])
                    for field_probs, t in zip(p.split([len(f.option_spans) for f in e.fields]), targets):
                        correct[src] = correct.get(src, 0) + int(int(field_probs.argmax()) == t)
                        total[src] = total.get(src, 0) + 1
        accuracy = {k: round(correct[k] / total[k], 4) for k in sorted(total)}
        log(f"held-out accuracy by source: {accuracy}")

        # save in the release layout: VL model (tiny random vision tower), bf16 shards, root head files
        vl = Qwen3_5ForConditionalGeneration(cfg)
        state = {f"{VL_BACKBONE_PREFIX}{k}": v for k, v in model.state_dict().items()}
        state["lm_head.weight"] = lm_head.weight.detach()
        missing, unexpected = vl.load_state_dict(state, strict=False)
        assert not unexpected and all(k.startswith("model.visual.") for k in missing), (missing[:5], unexpected[:5])
        vl = vl.to(torch.bfloat16).eval()
        vl.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
        vl.save_pretrained(str(staging), max_shard_size="8MB")
        save_file({k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in head.state_dict().items()},
                  str(staging / "joint_head.safetensors"), metadata={"format": "pt"})
        (staging / "joint_head_config.json").write_text(json.dumps(head_cfg.to_dict(), indent=2) + "\n")
    results.set("proxy", {"backbone_parameters": params, "head_parameters": sum(p.numel() for p in head.parameters()),
                          "layers": text_cfg.num_hidden_layers, "hidden": text_cfg.hidden_size, "vocab": text_cfg.vocab_size,
                          "train_records": len(examples), "heldout_accuracy": accuracy, "loss_history": history,
                          "seconds": round(time.perf_counter() - t0, 1)})
    return out


# --------------------------------------------------------------------------- builds


def build_all(work: Path, data: Path, device: torch.device, results: Results) -> dict[str, Path]:
    """BF16 + Hybrid K in {0, L/2, L}: quantize (native), shrink tables, clef_load."""
    from clef_vllm.model.checkpoint import locate_checkpoint
    from clef_vllm.tools import quantize_mixed, shrink_tables
    from clef_vllm.tools.clef_load import check_checkpoint

    source = work / "proxy-bf16"
    layers = locate_checkpoint(source).text_config["num_hidden_layers"]
    builds: dict[str, Path] = {}
    report = {}
    bf16 = work / "build-bf16"
    shutil.rmtree(bf16, ignore_errors=True)
    shrink_tables.shrink(source, bf16, None, False)
    builds["bf16"] = bf16
    for k in sorted({0, layers // 2, layers}):
        out = work / f"build-k{k}"
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        r = quantize_mixed.run(source, out, k, str(data), "native", 64, MAX_LEN, False, True, str(device))
        shrink_tables.shrink(out, None, None, False)
        check = check_checkpoint(out)
        builds[f"k{k}"] = out
        report[f"k{k}"] = {"split": k, "schemes": r["schemes"], "seconds": round(time.perf_counter() - t0, 1),
                           "clef_load_ok": check.ok, "clef_load_errors": check.errors(), "kernels": check.kernels,
                           "size_bytes": sum(p.stat().st_size for p in out.rglob("*.safetensors"))}
        log(f"built k{k}: {r['schemes']} clef_load {'PASS' if check.ok else 'FAIL ' + str(check.errors())}")
    report["bf16"] = {"size_bytes": sum(p.stat().st_size for p in bf16.rglob("*.safetensors"))}
    results.set("builds", report)
    return builds


# --------------------------------------------------------------------------- evaluation


def heldout_requests(data: Path, limit: int) -> list[dict]:
    from clef_vllm.schema.records import read_records, request_body

    return [request_body(r) for r in read_records(data, split="heldout", limit=limit)]


def encode_all(encoder, requests):
    from clef_vllm.schema.dialects import parse_request
    from clef_vllm.schema.protocol import RequestError

    out = []
    for body in requests:
        try:
            out.append(encoder.encode(parse_request(body)))
        except RequestError:
            out.append(None)
    return out


def simulate(work: Path, data: Path, device: torch.device, records: int, results: Results) -> None:
    """Reference backend + fake-quant Hybrid, against BF16, with a batch-composition noise floor."""
    from clef_vllm.quant.fake_quant import FakeQuant
    from clef_vllm.tools.sensitivity_scan import apply_hybrid, compare, field_distributions

    from clef_vllm.backends.reference import ReferenceBackend

    backend = ReferenceBackend(work / "build-bf16", device=str(device), dtype="bfloat16", max_model_len=MAX_LEN,
                               max_batch_size=16)
    encoded = [e for e in encode_all(backend.encoder, heldout_requests(data, records)) if e is not None]

    def run(batch_size: int = 16):
        backend.max_batch_size = batch_size
        with torch.inference_mode():
            return field_distributions(encoded, backend.decide_batch(encoded))

    ref = run(16)
    table = {"noise_floor_batch16_vs_1": compare(ref, run(1))}
    layers = len(backend.model.layers)
    for numerics in ("w4a16", "w4a4"):
        for k in sorted({0, layers // 2, layers}):
            if numerics == "w4a4" and k == layers:
                continue    # no NVFP4 layer: same as w4a16
            with FakeQuant() as fq:
                if numerics == "w4a4":   # calibrate activation global scales on train records first
                    from clef_vllm.schema.records import read_records
                    from clef_vllm.tools.sensitivity_scan import calibrate_input_amax, encode_records

                    fq.input_amax = calibrate_input_amax(backend, encode_records(
                        backend.encoder, read_records(data, limit=32), MAX_LEN)[0])
                apply_hybrid(fq, backend.model, k, numerics)
                table[f"k{k}_{numerics}"] = compare(ref, run(16))
            log(f"simulated k{k} {numerics}: {table.get(f'k{k}_{numerics}')}")
    results.set("simulated", {"records": len(encoded), "questions": len(ref), "layers": layers, "table": table})


def vllm_eval_subprocess(model: Path, requests_file: Path, out: Path, order: str, log_file: Path, timeout: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "vllm-eval", "--model", str(model), "--requests",
           str(requests_file), "--probs", str(out), "--order", order]
    t0 = time.perf_counter()
    with open(log_file, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env={**os.environ})
    return {"returncode": proc.returncode, "seconds": round(time.perf_counter() - t0, 1), "log": log_file.name}


def vllm_eval(model: Path, requests_file: Path, probs_out: Path, order: str) -> None:
    """One engine: decide every request through ``Clef(model, backend="vllm")``; save the probabilities."""
    from clef_vllm import Clef

    requests = json.loads(requests_file.read_text())
    t0 = time.perf_counter()
    backend = os.environ.get("CLEF_QUALITY_BACKEND", "vllm")    # "reference": CPU smoke test of this stage
    options = dict(gpu_memory_utilization=0.25, enforce_eager=True, max_num_seqs=64) if backend == "vllm" else {}
    clef = Clef(model, backend=backend, max_model_len=MAX_LEN, **options)
    start = time.perf_counter() - t0
    encoded = encode_all(clef.backend.encoder, requests)
    idx = [i for i, e in enumerate(encoded) if e is not None]
    probs: dict[int, torch.Tensor] = {}
    t1 = time.perf_counter()
    if order == "forward":
        for i, p in zip(idx, clef.backend.decide_batch([encoded[i] for i in idx])):
            probs[i] = p
    else:   # reversed order in chunks of 7: different batch composition
        rev = idx[::-1]
        for j in range(0, len(rev), 7):
            chunk = rev[j:j + 7]
            for i, p in zip(chunk, clef.backend.decide_batch([encoded[i] for i in chunk])):
                probs[i] = p
    decide_s = time.perf_counter() - t1
    kernels = getattr(clef.backend, "kernels", {})
    clef.close()
    torch.save({"probs": probs, "fields": {i: [len(f.option_spans) for f in encoded[i].fields] for i in idx},
                "engine_start_s": start, "decide_s": decide_s, "kernels": kernels}, probs_out)
    print(f"vllm-eval {model.name} {order}: {len(idx)} requests, engine start {start:.1f} s, decide {decide_s:.2f} s")


def vllm_stage(work: Path, data: Path, records: int, out: Path, results: Results, per_engine_timeout: int) -> None:
    from clef_vllm.tools.sensitivity_scan import compare

    requests = heldout_requests(data, records)
    requests_file = work / "heldout_requests.json"
    requests_file.write_text(json.dumps(requests))
    runs = [("bf16", "forward"), ("bf16", "reversed"), ("k0", "forward"), ("kmid", "forward"), ("kall", "forward")]
    builds = sorted(p for p in work.glob("build-k*"))
    names = {"bf16": work / "build-bf16"}
    ks = sorted(int(p.name.removeprefix("build-k")) for p in builds)
    if ks:
        names.update({"k0": work / f"build-k{ks[0]}", "kmid": work / f"build-k{ks[len(ks) // 2]}",
                      "kall": work / f"build-k{ks[-1]}"})
    meta, dist = {}, {}
    for name, order in runs:
        if name not in names:
            continue
        probs_file = work / f"probs-{name}-{order}.pt"
        key = f"{names[name].name}:{order}"
        try:
            meta[key] = vllm_eval_subprocess(names[name], requests_file, probs_file, order,
                                             out / f"vllm-{names[name].name}-{order}.log", per_engine_timeout)
        except subprocess.TimeoutExpired:
            meta[key] = {"returncode": "timeout"}
        if probs_file.is_file():
            saved = torch.load(probs_file)
            meta[key].update({"engine_start_s": round(saved["engine_start_s"], 1), "decide_s": round(saved["decide_s"], 2),
                              "kernels": saved["kernels"]})
            dist[key] = saved
        log(f"vLLM {key}: {meta[key]}")
        results.set("vllm_runs", meta)
    base = dist.get("build-bf16:forward")
    if base is None:
        results.set("vllm", {"error": "the BF16 engine run failed; see the vllm-*.log files"})
        return

    def flat(saved, keys):
        out = []
        for i in keys:
            out += list(saved["probs"][i].double().split(saved["fields"][i]))
        return out

    table = {}
    for key, saved in dist.items():
        if key == "build-bf16:forward":
            continue
        common = sorted(set(base["probs"]) & set(saved["probs"]))
        label = "noise_floor_bf16_vs_bf16" if key == "build-bf16:reversed" else key.split(":")[0]
        table[label] = compare(flat(base, common), flat(saved, common))
    results.set("vllm", {"records": len(base["probs"]), "table": table})


def write_markdown(out: Path, results: Results) -> None:
    d = results.data
    lines = ["# Hybrid quality on the Clef-architecture proxy", ""]
    env = d.get("environment", {})
    lines.append(f"GPU {env.get('gpu')} (SM{''.join(map(str, env.get('capability') or []))}), torch {env.get('torch')}, "
                 f"transformers {env.get('transformers')}, vLLM {env.get('vllm')}, compressed-tensors "
                 f"{env.get('compressed_tensors')}.")
    if "proxy" in d:
        p = d["proxy"]
        lines += ["", f"Proxy: {p['layers']} layers, hidden {p['hidden']}, vocab {p['vocab']}, "
                      f"{p['backbone_parameters'] / 1e6:.2f} M backbone + {p['head_parameters'] / 1e6:.2f} M head parameters, "
                      f"{p['train_records']} train records, trained in {p['seconds']} s.",
                  "Held-out accuracy: " + ", ".join(f"{k} {v:.3f}" for k, v in p["heldout_accuracy"].items())]
    for section, title in (("vllm", "Served through the plugin (vLLM), against vLLM BF16"),
                           ("simulated", "Reference backend with fake-quant, against reference BF16")):
        if section not in d or "table" not in d[section]:
            continue
        lines += ["", f"## {title}", "", f"{d[section].get('records')} held-out records.", "",
                  "| build | top-answer agreement | mean KL (nats) | max KL | mean TV |", "|---|---|---|---|---|"]
        for name, m in d[section]["table"].items():
            lines.append(f"| {name} | {m['agreement']:.4f} | {m['kl']:.2e} | {m['max_kl']:.2e} | {m['tv']:.4f} |")
    failed = {k: v for k, v in d.get("vllm_runs", {}).items() if v.get("returncode") != 0}
    if failed:
        lines += ["", "Engine runs that failed (see the logs): " + ", ".join(f"{k} ({v.get('returncode')}, {v.get('log')})"
                                                                          for k, v in failed.items())]
    if "builds" in d:
        lines += ["", "## Builds", "", "| build | schemes | clef_load | size |", "|---|---|---|---|"]
        for name, b in d["builds"].items():
            lines.append(f"| {name} | {b.get('schemes', '')} | {'PASS' if b.get('clef_load_ok', True) else 'FAIL'} | "
                         f"{b['size_bytes'] / 1e6:.1f} MB |")
    if d.get("errors"):
        lines += ["", "## Stage errors", ""] + [f"- {k}: {v.splitlines()[-1] if v else ''}" for k, v in d["errors"].items()]
    (out / "quality.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def run_all(a) -> int:
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    results = Results(out, work)
    results.set("environment", environment())
    device = torch.device(a.device)
    stages = [s for s in a.stages.split(",") if s]
    data = load_data(a.data, work, a.small)
    errors = dict(results.data.get("errors", {}))
    for stage in stages:
        t0 = time.perf_counter()
        log(f"== stage {stage}")
        try:
            if stage == "train":
                train_proxy(work, data, device, a.small, results)
            elif stage == "build":
                build_all(work, data, device, results)
            elif stage == "scan":
                from clef_vllm.tools import sensitivity_scan as S

                scan = S.scan(work / "build-bf16", str(data), a.scan_records, str(device), "w4a16", MAX_LEN, 16)
                k, budget = S.suggest_split(scan, None)
                scan["suggested_split"], scan["kl_budget"] = k, budget
                (out / "sensitivity_scan.json").write_text(json.dumps(scan, indent=2) + "\n")
                try:
                    S.plot(scan, out / "sensitivity_scan.png", k)
                except ImportError as exc:
                    log(f"no plot ({exc})")
                results.set("sensitivity", {"suggested_split": k, "kl_budget": budget,
                                            "splits": scan["splits"], "seconds": round(scan["seconds"], 1)})
            elif stage == "simulate":
                simulate(work, data, device, a.records, results)
            elif stage == "vllm":
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()     # the engines run in their own processes
                vllm_stage(work, data, a.records, out, results, a.engine_timeout)
            errors.pop(stage, None)
        except Exception:  # noqa: BLE001 - record and go on with the next stage
            errors[stage] = traceback.format_exc()
            log(f"stage {stage} FAILED:\n{errors[stage]}")
        results.set("errors", errors)
        results.set(f"seconds_{stage}", round(time.perf_counter() - t0, 1))
        write_markdown(out, results)
    if a.return_proxy and (work / "build-bf16").is_dir():
        shutil.copytree(work / "build-bf16", out / "proxy-bf16-int8", dirs_exist_ok=True)
    log(f"done; results in {out}/quality.json and quality.md")
    return 1 if errors else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a_all = sub.add_parser("all", help="run the stages")
    a_all.add_argument("--work", default="/root/clef-quality", help="scratch folder for checkpoints (not returned)")
    a_all.add_argument("--out", default="bench/results/quality", help="results folder ($OUT on the GPU machine)")
    a_all.add_argument("--data", help="build_data folder to use (default: synthetic records made here)")
    a_all.add_argument("--stages", default=",".join(STAGES))
    a_all.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a_all.add_argument("--records", type=int, default=400, help="held-out records evaluated")
    a_all.add_argument("--scan-records", type=int, default=128)
    a_all.add_argument("--engine-timeout", type=int, default=240, help="seconds per vLLM engine process")
    a_all.add_argument("--small", action="store_true", help="tiny proxy and few steps (CPU smoke test)")
    a_all.add_argument("--return-proxy", action="store_true", help="copy the repacked BF16 proxy into --out")
    a_eval = sub.add_parser("vllm-eval", help="(internal) one engine process")
    a_eval.add_argument("--model", type=Path, required=True)
    a_eval.add_argument("--requests", type=Path, required=True)
    a_eval.add_argument("--probs", type=Path, required=True)
    a_eval.add_argument("--order", choices=("forward", "reversed"), default="forward")
    a = ap.parse_args(argv)
    if a.cmd == "vllm-eval":
        vllm_eval(a.model, a.requests, a.probs, a.order)
        return 0
    return run_all(a)


if __name__ == "__main__":
    sys.exit(main())
