"""Where things live in a Clef checkpoint: file names and tensor-name prefixes (no torch).

Two layouts exist (:mod:`clef_vllm.model.checkpoint` finds and checks them):

* **release** (Cloudflare/clef-flash): ``joint_head.safetensors`` + ``joint_head_config.json`` at
  the root; ``embed_tokens`` and ``lm_head`` in the 16-bit backbone shards.
* **repacked** (our quantized builds): the head and its config in ``clef_head/`` (with the
  ``requires_clef_vllm`` marker) and both token tables as int8 in ``clef_head/tables_int8.safetensors``.

Backbone tensor names depend on the config, not on the layout: a VL-shaped config (one with a
``text_config``, as the release ships) keeps the text backbone under ``model.language_model.``;
a text-only config (``Qwen3_5ForCausalLM``) under ``model.``. :func:`backbone_prefix` is that rule.
"""

from __future__ import annotations

from typing import Mapping

#: The architecture name written into repacked checkpoints' config.json and used as
#: ``hf_overrides={"architectures": [...]}`` when serving the Cloudflare release.
ARCHITECTURE = "ClefFlashForDecision"

HEAD_DIR = "clef_head"
HEAD_CONFIG = "joint_head_config.json"
HEAD_WEIGHTS = "joint_head.safetensors"
TABLES = "tables_int8.safetensors"
INDEX = "model.safetensors.index.json"
MARKER = "requires_clef_vllm"

#: Backbone prefix of a VL-shaped checkpoint (the release) and of a text-only one.
VL_BACKBONE_PREFIX = "model.language_model."
TEXT_BACKBONE_PREFIX = "model."
BACKBONE_PREFIXES = (VL_BACKBONE_PREFIX, TEXT_BACKBONE_PREFIX)
#: Tensors the text path never loads: the vision tower and the multi-token-prediction head.
VISION_PREFIXES = ("model.visual.", "visual.")
NOT_TEXT_PREFIXES = VISION_PREFIXES + ("mtp.",)

EMBED_KEYS = (VL_BACKBONE_PREFIX + "embed_tokens.weight", TEXT_BACKBONE_PREFIX + "embed_tokens.weight")
LM_HEAD_KEYS = ("lm_head.weight", VL_BACKBONE_PREFIX + "lm_head.weight")


def backbone_prefix(config: Mapping) -> str:
    """The prefix of the text backbone's tensor names in a checkpoint with this ``config.json``."""
    return VL_BACKBONE_PREFIX if isinstance(config.get("text_config"), Mapping) else TEXT_BACKBONE_PREFIX


def text_config(config: Mapping) -> Mapping:
    """The text model's config: ``text_config`` of a VL-shaped config, else the config itself."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def linear_shapes(text: dict) -> dict[str, tuple[int, int]]:
    """``[out, in]`` of every Qwen3.5 text linear leaf (HF names), from the config."""
    h, inter = text["hidden_size"], text["intermediate_size"]
    heads, kv, hd = text["num_attention_heads"], text["num_key_value_heads"], text.get("head_dim") or h // text["num_attention_heads"]
    kh, vh = text["linear_num_key_heads"], text["linear_num_value_heads"]
    kd, vd = text["linear_key_head_dim"], text["linear_value_head_dim"]
    return {"q_proj": (2 * heads * hd, h), "k_proj": (kv * hd, h), "v_proj": (kv * hd, h), "o_proj": (h, heads * hd),
            "in_proj_qkv": (2 * kh * kd + vh * vd, h), "in_proj_z": (vh * vd, h), "in_proj_b": (vh, h),
            "in_proj_a": (vh, h), "out_proj": (h, vh * vd), "gate_proj": (inter, h), "up_proj": (inter, h),
            "down_proj": (h, inter)}
