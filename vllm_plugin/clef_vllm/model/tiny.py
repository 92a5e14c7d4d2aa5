"""Tiny Clef checkpoints in the EXACT release layout, built in seconds, deterministically.

The demo checkpoint (:mod:`clef_vllm.model.demo`), the test suite and the GPU checks use them; users make
one with ``clef-make-tiny OUT`` (e.g. to try the scripts of docs/scripts.md).

``build_tiny_checkpoint(out)`` writes what Cloudflare/clef-flash ships, at toy size:
``config.json`` (``Qwen3_5ForConditionalGeneration``, text + a 1-block vision config),
``generation_config.json``, sharded ``model-0000N-of-0000M.safetensors`` + index (bf16,
``model.language_model.*``, ``model.visual.*``, ``lm_head.weight``, optionally ``mtp.*``),
``tokenizer.json`` / ``tokenizer_config.json`` / ``chat_template.jinja`` (a 1,024-token
byte-level BPE with the Qwen3.5 special tokens), the release's processor configs
(``preprocessor_config.json``, ...), ``joint_head.safetensors`` and
``joint_head_config.json``. ``layout="repacked"`` then moves the head to ``clef_head/`` and the
tables to int8 (:mod:`clef_vllm.model.repack`).

Weights are random but scaled so that answers are not flat.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

from clef_vllm.model.head import HeadConfig, JointSchemaHead
from clef_vllm.model.processor_config import write_processor_configs
from clef_vllm.schema.encoding import PREFIX_TEXT, SCHEMA_HEADER_TEXT, SUFFIX_TEXT
from clef_vllm.util.atomic import atomic_dir

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
]
# Qwen3.5's pre-tokenizer split regex (the one in the release's tokenizer.json).
QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
              r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
CHAT_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)
_WORDS = (
    "the a an is are was be to of and in that it for on with as at by from this not or but have has had do does "
    "did will would can could should may might must yes no true false customer order invoice payment refund "
    "billing technical sales account support ticket urgent issue error outage service server database network "
    "login password email user team product price plan upgrade cancel status paid overdue draft total currency "
    "vendor amount date time day week month year today tomorrow question answer option field type choice score "
    "noul instruction description criteria state schema decision model request response minor major critical "
    "impact low medium high none some many every all each other new old good bad positive negative neutral "
    "happy sad angry calm fast slow large small first last next previous open closed pending failed success "
    "checkout cart shipping delivery address phone message chat agent human bot spam phishing fraud safe risk "
    "security incident alert warning information debug log event severity priority level category label intent "
    "greeting hello world please thanks sorry help need want know think see make take give find tell ask work "
    "call try feel leave put mean keep let begin seem show hear play run move live believe hold bring happen "
    "write provide sit stand lose pay meet include continue set learn change lead understand watch follow stop "
    "create speak read allow add spend grow offer remember love consider appear buy wait serve die send expect "
    "build stay fall cut reach kill remain suggest raise pass sell require report decide pull is_urgent reason"
).split()


def _corpus(seed: int = 0, lines: int = 6000) -> list[str]:
    """Deterministic training text: the prompt template, JSON objects and sentences."""
    rng = random.Random(seed)
    out = [PREFIX_TEXT, SCHEMA_HEADER_TEXT, SUFFIX_TEXT] * 50
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        kind = i % 4
        if kind == 0:
            out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!"]))
        elif kind == 1:
            obj = {w: rng.choice([rng.randint(0, 9999), rng.random() * 1000, w.upper(), True, None])
                   for w in words[:4]}
            out.append(json.dumps(obj, sort_keys=True, separators=(",", ":")))
        elif kind == 2:
            out.append(f"\nFIELD {rng.randint(1, 12)}\nID: {words[0]}_{words[1]}\nTYPE: "
                       f"{rng.choice(['noul', 'choice', 'score'])}\nINSTRUCTION: {' '.join(words)}?")
        else:
            out.append(f"OPTION {rng.randint(1, 12)}: " + json.dumps(
                {"description": " ".join(words[1:]), "option_id": words[0]}, sort_keys=True, separators=(",", ":")))
    return out


def build_tokenizer(out: Path, vocab_size: int = 1024, seed: int = 0):
    """Train and save a byte-level BPE with Qwen3.5's split regex and special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS), min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 unk_token=None, model_max_length=262144)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out))
    return hf


def tiny_text_config(ids: dict[str, int], vocab: int, hidden: int = 128, layers: int = 4) -> dict:
    return dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        full_attention_interval=4,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        max_position_embeddings=262144, rms_norm_eps=1e-6, initializer_range=0.02, hidden_act="silu",
        attention_bias=False, attention_dropout=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                         "mrope_section": [4, 2, 2], "mrope_interleaved": True},
        attn_output_gate=True, mamba_ssm_dtype="float32", mtp_num_hidden_layers=0,
        mtp_use_dedicated_embeddings=False, mlp_only_layers=[], tie_word_embeddings=False,
        eos_token_id=ids["<|endoftext|>"], pad_token_id=None, bos_token_id=None, dtype="bfloat16")


def tiny_head_config(hidden: int) -> HeadConfig:
    return HeadConfig(hidden_size=hidden, width=64, routing_layers=2, layers=2, heads=4, feedforward=128)


def build_head(config: HeadConfig, seed: int) -> JointSchemaHead:
    """A random head whose logits spread over a few units (answers not flat)."""
    torch.manual_seed(seed)
    head = JointSchemaHead(config)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=1.0 / p.shape[-1] ** 0.5)
            elif name.endswith("bias"):
                torch.nn.init.normal_(p, std=0.05)
            elif name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        head.prior_logit_scale.fill_(1.5)    # sigma_p ~ 4.5
        head.joint_logit_scale.fill_(1.5)    # sigma_j ~ 4.5
        head.residual_gate.fill_(0.5)
    return head


def build_tiny_checkpoint(out: str | Path, *, layout: str = "release", seed: int = 0, hidden: int = 128,
                          layers: int = 4, mtp: bool = False, shard_mb: float = 1.0, marker: str | None = None,
                          embed_std: float = 1.0) -> Path:
    """Build a tiny checkpoint at ``out`` (must not exist). ``layout``: ``release`` or ``repacked``.

    The folder appears only when complete (:mod:`clef_vllm.util.atomic`)."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(out)
    if layout not in ("release", "repacked"):
        raise ValueError("layout must be 'release' or 'repacked'")
    kw = dict(seed=seed, hidden=hidden, layers=layers, mtp=mtp, shard_mb=shard_mb, embed_std=embed_std)
    if layout == "release":
        with atomic_dir(out) as tmp:
            _write_release(tmp, **kw)
        return out
    from clef_vllm.model.repack import repack_tables

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.release-", dir=out.parent) as work:
        _write_release(Path(work), **kw)
        repack_tables(work, out, marker=marker)
    return out


def _write_release(release: Path, *, seed: int, hidden: int, layers: int, mtp: bool, shard_mb: float,
                   embed_std: float) -> None:
    """Every file of the release layout, into the existing (empty) folder ``release``."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    tok = build_tokenizer(release, seed=seed)
    (release / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    write_processor_configs(release)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab = (len(tok) + 63) // 64 * 64
    text = tiny_text_config(ids, vocab, hidden, layers)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                  in_channels=3, deepstack_visual_indexes=[])
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False,
                        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(cfg)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 7)
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * embed_std)
            elif "norm" in name:  # zero-centred RMSNorm weights off 0, so w vs 1+w shows
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model = model.to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = ids["<|endoftext|>"]
    model.save_pretrained(str(release), max_shard_size=f"{int(shard_mb * 1024)}KB")
    if mtp:
        _add_mtp(release, model, text)

    head_cfg = tiny_head_config(hidden)
    head = build_head(head_cfg, seed + 1).to(torch.bfloat16)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()},
              str(release / "joint_head.safetensors"), metadata={"format": "pt"})
    (release / "joint_head_config.json").write_text(json.dumps(head_cfg.to_dict(), indent=2) + "\n")


def _add_mtp(root: Path, model, text: dict) -> None:
    """Append ``mtp.*`` tensors (one full-attention layer + fc + norms) as Qwen3.5 checkpoints carry."""
    from safetensors.torch import load_file, save_file

    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    sd = model.state_dict()
    full = text["layer_types"].index("full_attention")
    pre = f"model.language_model.layers.{full}."
    h = text["hidden_size"]
    mtp = {"mtp.layers.0." + k[len(pre):]: v.clone() for k, v in sd.items() if k.startswith(pre)}
    mtp["mtp.fc.weight"] = torch.zeros(h, 2 * h, dtype=torch.bfloat16)
    for n in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        mtp[f"mtp.{n}.weight"] = torch.zeros(h, dtype=torch.bfloat16)
    shard = sorted(set(index["weight_map"].values()))[-1]
    merged = load_file(str(root / shard))
    merged.update(mtp)
    save_file(merged, str(root / shard), metadata={"format": "pt"})
    index["weight_map"].update({k: shard for k in mtp})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index_path.write_text(json.dumps(index, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    """``clef-make-tiny OUT``: a tiny random Clef checkpoint (seconds on a CPU), e.g. to try the scripts."""
    ap = argparse.ArgumentParser(prog="clef-make-tiny", description=main.__doc__.split(": ", 1)[1])
    ap.add_argument("out", type=Path, help="output folder (must not exist)")
    ap.add_argument("--layout", choices=("release", "repacked"), default="release",
                    help="release: the Cloudflare release's files (default); repacked: clef_head/ + int8 tables")
    ap.add_argument("--mtp", action="store_true", help="also write mtp.* tensors, as Qwen3.5 checkpoints carry")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.out.exists():
        ap.error(f"{a.out} exists; choose a new folder")
    build_tiny_checkpoint(a.out, layout=a.layout, mtp=a.mtp, seed=a.seed)
    print(f"wrote a tiny {a.layout}-layout Clef checkpoint (random weights) to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
