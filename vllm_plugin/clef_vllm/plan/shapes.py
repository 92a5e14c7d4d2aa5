"""The shapes of a Clef checkpoint that decide its GPU memory: its linears' weights by quantization scheme, the
backbone's other parameters, the joint head, and the KV cache's layout as vLLM 0.28 counts it.

Pure arithmetic on config dicts (:class:`ModelShape`, :class:`KvLayout`): no torch, no GPU, no vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

GIB = 1 << 30

#: vLLM's attention kernels' block alignment (FlashAttention / FlashInfer: multiples of 16 tokens).
KERNEL_BLOCK_ALIGNMENT = 16
NVFP4_GROUP = 16
#: vLLM's ``MRotaryEmbedding`` caches cos/sin for this many times ``max_position_embeddings`` (video positions).
MROPE_CACHE_FACTOR = 4
FP8_KINDS = ("fp8_w8a8", "fp8_w8a16")
NVFP4_KINDS = ("nvfp4_w4a4", "nvfp4_w4a16")
NVFP4_KERNELS = ("bf16", "vllm")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "bf16": 2, "fp16": 2, "fp32": 4}


# --------------------------------------------------------------------------- the model's shapes


@dataclass(frozen=True)
class KvLayout:
    """How vLLM 0.28 lays out the KV cache of a hybrid (attention + GDN) model and counts its capacity.

    * Block size (``Platform._align_hybrid_block_size``, mamba cache mode ``none`` / ``align``): the
      smallest multiple of the kernel alignment whose attention page (``block x 2 x kv_heads x head_dim x
      2 bytes`` per layer) holds one GDN state (conv state ``conv_dim x (kernel - 1)`` in the model dtype
      + recurrent state ``v_heads x v_dim x k_dim`` in ``mamba_ssm_dtype``); GDN pages are padded to it.
    * Groups (``_get_kv_cache_groups_uniform_page_size``): layers of one kind in groups of the smaller
      kind's count (the larger one's when it is under 1.5x), so the 9B's 8 attention + 24 GDN layers are 4
      groups of 8; every group shares ``group_size`` tensors of one page per block.
    * Blocks (``get_kv_cache_config_from_groups``): ``kv_bytes // page // group_size``.
    * Capacity (``get_max_concurrency_for_kv_cache_config``): a ``max_model_len`` request takes
      ``ceil(max_model_len / block)`` blocks per attention group and 1 (``none``) or 2 (``align``: prefix
      caching, the state cache) per GDN group; concurrency = blocks / that sum, and the logged token count
      is ``int(concurrency x max_model_len)``.
    """

    attention_layers: int
    gdn_layers: int
    block_size: int
    page_bytes: int
    group_size: int
    attention_groups: int
    gdn_groups: int

    @classmethod
    def from_text_config(cls, text: Mapping, dtype_bytes: int = 2) -> "KvLayout":
        types = layer_types(text)
        attn = sum(t == "full_attention" for t in types)
        gdn = sum(t == "linear_attention" for t in types)
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        token_page = 2 * text["num_key_value_heads"] * head_dim * dtype_bytes
        block = KERNEL_BLOCK_ALIGNMENT
        if gdn:
            mamba_page = gdn_state_bytes(text, dtype_bytes)
            block = KERNEL_BLOCK_ALIGNMENT * -(-mamba_page // (KERNEL_BLOCK_ALIGNMENT * token_page))
        counts = [n for n in (attn, gdn) if n]
        group = min(counts)
        if max(counts) < 1.5 * group:
            group = max(counts)
        return cls(attn, gdn, block, block * token_page, group, -(-attn // group) if attn else 0,
                   -(-gdn // group) if gdn else 0)

    def blocks(self, kv_bytes: int) -> int:
        """KV blocks vLLM makes of ``kv_bytes``."""
        return max(int(kv_bytes) // self.page_bytes // self.group_size, 0)

    def blocks_per_sequence(self, max_model_len: int, prefix_caching: bool) -> int:
        """Blocks one ``max_model_len`` request takes, summed over the groups."""
        return self.attention_groups * -(-max_model_len // self.block_size) + self.gdn_groups * (
            2 if prefix_caching else 1)

    def concurrency(self, kv_bytes: int, max_model_len: int, prefix_caching: bool) -> float:
        """vLLM's "Maximum concurrency for N tokens per request"."""
        return self.blocks(kv_bytes) / self.blocks_per_sequence(max_model_len, prefix_caching)

    def tokens(self, kv_bytes: int, max_model_len: int, prefix_caching: bool) -> int:
        """vLLM's "GPU KV cache size: N tokens"."""
        return int(self.concurrency(kv_bytes, max_model_len, prefix_caching) * max_model_len)

    def bytes_for(self, sequences: float, max_model_len: int, prefix_caching: bool) -> int:
        """The fewest KV bytes that hold ``sequences`` requests of ``max_model_len`` tokens."""
        blocks = math.ceil(sequences * self.blocks_per_sequence(max_model_len, prefix_caching))
        return blocks * self.page_bytes * self.group_size

    @property
    def attention_bytes_per_token(self) -> int:
        """KV bytes one token takes in the attention layers (what the state cache's share is set against)."""
        return self.attention_layers * self.page_bytes // self.block_size


def layer_types(text: Mapping) -> list[str]:
    """``layer_types`` of a Qwen3.5 text config (or the ``full_attention_interval`` rule)."""
    n = int(text["num_hidden_layers"])
    return list(text.get("layer_types") or [
        "full_attention" if (i + 1) % int(text.get("full_attention_interval", 4)) == 0 else "linear_attention"
        for i in range(n)])


def gdn_state_bytes(text: Mapping, dtype_bytes: int = 2) -> int:
    """One GDN layer's state per sequence (vLLM's ``gated_delta_net_state_shape`` / ``_dtype``): the conv
    state in the model dtype, the recurrent state in ``mamba_ssm_dtype`` (float32 for Qwen3.5)."""
    kh, vh = text["linear_num_key_heads"], text["linear_num_value_heads"]
    kd, vd = text["linear_key_head_dim"], text["linear_value_head_dim"]
    conv = (2 * kh * kd + vh * vd) * (text["linear_conv_kernel_dim"] - 1) * dtype_bytes
    ssm_bytes = DTYPE_BYTES.get(str(text.get("mamba_ssm_dtype") or "").removeprefix("torch."), dtype_bytes)
    return conv + vh * vd * kd * ssm_bytes


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs from a checkpoint, counted from its ``config.json`` and head config.

    Linear weights are counted per scheme as vLLM 0.28 resolves it
    (:func:`clef_vllm.quant.schemes.scheme_table`) over the leaf shapes
    :func:`clef_vllm.model.layout.linear_shapes` gives."""

    fp8_weights: int               # FP8 linear weights
    fp8_channels: int              # their output channels (one float32 scale each)
    fp8_modules: int
    nvfp4_weights: int
    nvfp4_modules: int             # vLLM modules (fused shards share one set of global scales)
    nvfp4_layers: tuple[int, ...]
    fp8_layers: tuple[int, ...]
    bf16_linear_weights: int       # unquantized linears
    leftover_bytes: int            # norms, GDN conv1d / A_log / dt_bias, rotary cache (vLLM's dtypes)
    vocab: int
    hidden: int
    intermediate: int
    num_layers: int
    int8_tables: bool              # repacked checkpoint: int8 tables + row scales
    vision: bool                   # the config has a vision tower
    head_params: int
    head_width: int
    kv: KvLayout
    #: The GDN layers' (key heads, value heads, key dim, value dim, recurrent-state bytes); ``()`` without them.
    gdn: tuple[int, ...] = ()
    #: The vision tower's parameters (BF16 in every layout) and its (hidden, intermediate, output) widths.
    vision_params: int = 0
    vision_widths: tuple[int, ...] = ()

    @classmethod
    def from_configs(cls, config: Mapping, head_config, *, int8_tables: bool = True) -> "ModelShape":
        """``config``: the checkpoint's ``config.json`` dict; ``head_config``: ``joint_head_config.json`` as a
        dict or a :class:`clef_vllm.model.head.HeadConfig`; ``int8_tables``: the repacked layout's int8 tables."""
        from clef_vllm.model.head import HeadConfig, count_parameters
        from clef_vllm.model.layout import linear_shapes, text_config
        from clef_vllm.quant import schemes as S

        if not isinstance(head_config, HeadConfig):
            head_config = HeadConfig.from_dict(dict(head_config))
        text = text_config(config)
        shapes = linear_shapes(text)
        counts = dict(fp8_weights=0, fp8_channels=0, fp8_modules=0, nvfp4_weights=0, nvfp4_modules=0,
                      bf16_linear_weights=0)
        fp8_layers, nvfp4_layers = set(), set()
        for row in S.scheme_table(config):
            n = sum(shapes[s][0] for s in row.module.shards)
            k = shapes[row.module.shards[0]][1]
            if row.kind in FP8_KINDS:
                counts["fp8_weights"] += n * k
                counts["fp8_channels"] += n
                counts["fp8_modules"] += 1
                fp8_layers.add(row.module.layer)
            elif row.kind in NVFP4_KINDS:
                counts["nvfp4_weights"] += n * k
                counts["nvfp4_modules"] += 1
                nvfp4_layers.add(row.module.layer)
            elif row.kind == S.UNQUANTIZED:
                counts["bf16_linear_weights"] += n * k
            else:
                raise ValueError(f"{row.name}: scheme {row.kind} is outside what the memory plan counts")
        return cls(**counts, nvfp4_layers=tuple(sorted(nvfp4_layers)), fp8_layers=tuple(sorted(fp8_layers)),
                   leftover_bytes=_leftover_bytes(text), vocab=int(text["vocab_size"]),
                   hidden=int(text["hidden_size"]), intermediate=int(text["intermediate_size"]),
                   num_layers=int(text["num_hidden_layers"]), int8_tables=int8_tables,
                   vision=isinstance(config.get("vision_config"), Mapping),
                   head_params=count_parameters(head_config), head_width=head_config.width,
                   kv=KvLayout.from_text_config(text), gdn=_gdn_dims(text), **_vision(config.get("vision_config")))


def vision_parameters(vision: Mapping) -> int:
    """Parameters of vLLM's Qwen3.5 vision tower for a ``vision_config``: the patch embedding (a 3-D convolution
    over ``temporal_patch_size x patch_size^2`` pixels of each channel, with a bias), the learned position table,
    ``depth`` blocks (two LayerNorms, the fused qkv and output projections, a two-layer MLP, all with biases), and
    the patch merger (a LayerNorm, then two linears over ``merge^2`` neighbouring patches), one more merger per
    deepstack level."""
    h, inner, out = int(vision["hidden_size"]), int(vision["intermediate_size"]), int(vision["out_hidden_size"])
    patch = int(vision.get("in_channels", 3)) * int(vision["temporal_patch_size"]) * int(vision["patch_size"]) ** 2
    merged = h * int(vision["spatial_merge_size"]) ** 2
    block = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (inner * h + inner) + (h * inner + h)
    linears = (merged * merged + merged) + (out * merged + out)
    deepstack = len(vision.get("deepstack_visual_indexes") or ())     # their norms span the merged width
    return (patch * h + h + int(vision["num_position_embeddings"]) * h + int(vision["depth"]) * block
            + 2 * h + linears + deepstack * (2 * merged + linears))


def _vision(vision: Mapping | None) -> dict:
    if not isinstance(vision, Mapping):
        return {}
    return {"vision_params": vision_parameters(vision),
            "vision_widths": (int(vision["hidden_size"]), int(vision["intermediate_size"]),
                              int(vision["out_hidden_size"]))}


def _gdn_dims(text: Mapping) -> tuple[int, ...]:
    if "linear_attention" not in layer_types(text):
        return ()
    ssm = DTYPE_BYTES.get(str(text.get("mamba_ssm_dtype") or "").removeprefix("torch."), 2)
    return (int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"]), int(text["linear_key_head_dim"]),
            int(text["linear_value_head_dim"]), ssm)


def _leftover_bytes(text: Mapping, dtype_bytes: int = 2) -> int:
    """The backbone's parameters and buffers outside its linears and token tables, in vLLM's dtypes: RMSNorm
    weights, GDN ``conv1d`` / ``dt_bias`` / gated norm (model dtype) and ``A_log`` (float32), attention
    q/k norms, the final norm, and the rotary cos/sin cache (``max_position_embeddings x rotary_dim``, 4x the
    positions with M-RoPE: the plugin's class keeps the config's ``mrope_section``)."""
    h = text["hidden_size"]
    head_dim = text.get("head_dim") or h // text["num_attention_heads"]
    kh, vh = text["linear_num_key_heads"], text["linear_num_value_heads"]
    kd, vd = text["linear_key_head_dim"], text["linear_value_head_dim"]
    conv = (2 * kh * kd + vh * vd) * text["linear_conv_kernel_dim"]
    total = h * dtype_bytes                                               # final norm
    for kind in layer_types(text):
        total += 2 * h * dtype_bytes                                      # input / post-attention norms
        if kind == "linear_attention":
            total += (conv + vh + vd) * dtype_bytes + vh * 4              # conv1d, dt_bias, norm; A_log fp32
        else:
            total += 2 * head_dim * dtype_bytes                           # q_norm, k_norm
    rope = text.get("rope_parameters") or {}
    rotary = int(head_dim * float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))))
    positions = int(text.get("max_position_embeddings", 0))
    positions *= MROPE_CACHE_FACTOR if "mrope_section" in rope else 1
    return total + positions * rotary * dtype_bytes


def model_shape_for_checkpoint(model_dir: str | Path) -> ModelShape:
    """The :class:`ModelShape` of a checkpoint folder (weights not needed: a config-only folder will do)."""
    from clef_vllm.model.checkpoint import load_head_config, locate_checkpoint

    files = locate_checkpoint(model_dir, require_weights=False)
    return ModelShape.from_configs(files.config, load_head_config(files), int8_tables=files.layout == "repacked")
