"""``ClefFlashForDecision``: Clef-Flash as a vLLM 0.28 pooling model.

Composes vLLM's own Qwen3.5 text backbone (``Qwen3_5Model``: GDN + gated full attention,
quantization per layer through the checkpoint's compressed-tensors config) and declares the
hybrid / mamba-state / M-RoPE hooks vLLM needs for a custom Qwen3.5 class (the Qwen3.5
config hooks in vLLM's ``MODELS_CONFIG_MAP`` do not run for a custom architecture). The joint
head and the lm_head table live on the model and run inside the worker through
:class:`~clef_vllm.worker.pooler.ClefPooler`.

Weights: the backbone streams through vLLM's loader (both layouts; vision and MTP tensors are
skipped; ``lm_head.weight`` of the release goes to the lexical table). The head and the int8
tables are read with :mod:`clef_vllm.model.checkpoint` / :mod:`clef_vllm.model.tables` — the same loaders
as the reference backend — and both tables stay int8 with their row scales on the GPU (the
embedding: :class:`~clef_vllm.worker.embedding.Int8RowEmbedding`). After loading, every expected tensor must have arrived and be
finite, or the model refuses to start (vLLM does not check this for quantized checkpoints).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsMRoPE, SupportsMultiModal
from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLMBase, Qwen3_5Model, Qwen3_5ProcessingInfo
from vllm.model_executor.models.qwen3_vl import Qwen3VLDummyInputsBuilder
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.platforms import current_platform

from clef_vllm.contract import WorkerSettings
from clef_vllm.model.checkpoint import CheckpointError, load_head_config, load_head_state, locate_checkpoint
from clef_vllm.model.features import PADDED_ROWS_FLOOR
from clef_vllm.model.head import JointSchemaHead
from clef_vllm.model.layout import LM_HEAD_KEYS, NOT_TEXT_PREFIXES, TEXT_BACKBONE_PREFIX, VISION_PREFIXES
from clef_vllm.model.tables import DenseTable, Int8RowTable, load_int8_tables
from clef_vllm.quant.fused_scales import fused_global_scales
from clef_vllm.quant.kernels import kernel_report
from clef_vllm.quant.schemes import FUSED_MODULES, PLUGIN_NAME_MAP
from clef_vllm.util import trace
from clef_vllm.worker import memory, vision
from clef_vllm.worker.dummy_loader import is_dummy
from clef_vllm.worker.embedding import Int8RowEmbedding
from clef_vllm.worker.fast.registry import (DEFAULT_BUCKETS, SPLIT_TOKENS, GdnGraphRunner, HeadGraphRunner,
                                            StepGraphRunner, gdn_metadata, gdn_tuning, nvfp4_bf16, triton_gdn)
from clef_vllm.worker.pooler import ClefPooler, StateCacheSettings
from clef_vllm.worker.processor import ClefMultiModalProcessor

log = logging.getLogger("clef_vllm")

#: Log the prefill- and head-graph counters every this many forward steps.
GRAPH_REPORT_EVERY = 2000
# fp8 e4m3fn NaN encodings (S.1111.111); the format has no infinities.
_FP8_NAN = (0x7F, 0xFF)


def _all_finite(t: torch.Tensor) -> bool:
    if t.dtype in (torch.float8_e4m3fn,):
        b = t.view(torch.uint8)
        return not bool(((b == _FP8_NAN[0]) | (b == _FP8_NAN[1])).any())
    if t.is_floating_point():
        return bool(torch.isfinite(t).all())
    return True



# vLLM's Qwen3.5 media processing (the checkpoint's processors expand each image's and video's placeholder).
@MULTIMODAL_REGISTRY.register_processor(ClefMultiModalProcessor, info=Qwen3_5ProcessingInfo,
                                        dummy_inputs=Qwen3VLDummyInputsBuilder)
class ClefFlashForDecision(nn.Module, HasInnerState, IsHybrid, SupportsMRoPE, SupportsMultiModal):
    """Qwen3.5 backbone (+ its BF16 vision tower unless the engine serves text only) + joint schema head, served
    through the ``plugin`` pooling task."""

    is_pooling_model = True
    # Both from clef_vllm.quant.schemes, which resolves quantization schemes with the same names.
    packed_modules_mapping = {fused: list(shards) for fused, shards in FUSED_MODULES.items()}
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_prefix=dict(PLUGIN_NAME_MAP) | dict(vision.NAME_MAP))
    # With images on, vLLM hands every step's embeddings; the ids too, so that a step without image tokens
    # still runs the step graphs (captured on ids).
    requires_raw_input_tokens = True

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        return vision.placeholder(modality)

    # vLLM's Qwen3.5 mamba-state hooks, reused as they are.
    get_mamba_state_dtype_from_config = classmethod(
        Qwen3_5ForCausalLMBase.get_mamba_state_dtype_from_config.__func__)
    get_mamba_state_shape_from_config = classmethod(
        Qwen3_5ForCausalLMBase.get_mamba_state_shape_from_config.__func__)
    get_mamba_state_copy_func = classmethod(Qwen3_5ForCausalLMBase.get_mamba_state_copy_func.__func__)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        model_config = vllm_config.model_config
        config = model_config.hf_text_config
        if vllm_config.cache_config.mamba_cache_mode == "all":
            raise NotImplementedError("Clef-Flash (Qwen3.5) does not support mamba_cache_mode='all'")
        settings = WorkerSettings.of(vllm_config)       # SettingsError naming a bad one stops the engine here
        memo = settings.gdn_metadata_memo
        if gdn_metadata.install(memo):      # before vLLM makes its metadata builders (at KV-cache init)
            log.info("clef GDN metadata: built once per step and shared by the GDN KV-cache groups%s",
                     "; single-prefill steps of a length seen before reuse it" if memo else
                     " (--gdn-metadata-memo off: every step builds its own)")
        nvfp4_bf16.install(settings.nvfp4_kernel)   # before the layers exist
        self.config = config
        self.config_full = model_config.hf_config
        self.dummy = is_dummy(vllm_config.load_config.load_format)
        self.files = locate_checkpoint(model_config.model, require_weights=not self.dummy)
        head_config = load_head_config(self.files)          # checks requires_clef_vllm in every worker
        if head_config.hidden_size != config.hidden_size:
            raise CheckpointError(f"{self.files.head_config_file}: hidden_size {head_config.hidden_size} "
                                  f"!= backbone hidden_size {config.hidden_size}")
        self.model = Qwen3_5Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        #: the BF16 vision tower, or None (text only: every media limit 0, or no vision config)
        self.visual = vision.build_tower(vllm_config)
        self._step_media = False          # this step's embeddings hold image features (embed_input_ids says)
        if self.files.layout == "repacked":    # the int8 table stays int8: vLLM's 16-bit embedding goes
            self.model.embed_tokens = Int8RowEmbedding(config.vocab_size, config.hidden_size, model_config.dtype)
            if self.dummy:                     # vLLM's dummy loaders fill parameters only
                self.model.embed_tokens.fill_dummy()
        self.head = JointSchemaHead(head_config).to(dtype=getattr(torch, settings.head_dtype))
        vocab, hidden = config.vocab_size, config.hidden_size
        if self.files.layout == "repacked":
            self.lm_table = Int8RowTable(torch.zeros(vocab, hidden, dtype=torch.int8), torch.ones(vocab))
        else:
            self.lm_table = DenseTable(torch.zeros(vocab, hidden, dtype=model_config.dtype))
        #: one token's KV-cache bytes: the state cache and the worker's budget size the head's memory rows by it
        self.kv_bytes_per_token = self._kv_bytes_per_token(config, vllm_config)
        self.pooler = ClefPooler(self.head, self.lm_table, self._state_cache_settings(vllm_config, settings),
                                 self._head_graphs(vllm_config, settings), self._gemm_warmup_rows(vllm_config, settings),
                                 settings.gemm_row_grid,
                                 max_decision_rows=max(vllm_config.model_config.max_model_len, PADDED_ROWS_FLOOR))
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        self._global_scales: dict[str, torch.Tensor] = {}
        self.prefill_graphs = self._install_prefill_graphs(vllm_config, settings)
        self.step_graphs = self._step_graphs(vllm_config, settings)
        self._gdn_tuning = self._install_gdn_tuning(vllm_config, settings)
        self._steps = 0
        if current_platform.is_cuda():     # what the plugin's own GPU work holds is said against this budget
            memory.LEDGER.budget_fraction = float(vllm_config.cache_config.gpu_memory_utilization)
        if trace.PATH is not None:          # engine_done events carry their counters; steps their runner events
            trace.REPORTERS.update((name, runner.describe) for name, runner in self.graph_runners().items())
            trace.instrument_runner()
            trace.instrument_output("engine")

    @property
    def takes_media(self) -> bool:
        """Whether this engine sees images (its vision tower is built)."""
        return self.visual is not None

    def graph_runners(self) -> dict:
        """The graph runners that are on (prefill, step, head), by name (their counters: ``describe()``)."""
        runners = (("prefill", self.prefill_graphs), ("step", self.step_graphs), ("head", self.pooler.head_graphs))
        return {name: runner for name, runner in runners if runner is not None}

    @staticmethod
    def _kv_bytes_per_token(config, vllm_config: VllmConfig) -> int:
        """What one token costs in the KV cache's attention layers."""
        layers = sum(t == "full_attention" for t in getattr(config, "layer_types", ()) or ()) or 1
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_dtype = vllm_config.model_config.dtype if vllm_config.cache_config.cache_dtype == "auto" else torch.uint8
        return layers * 2 * config.num_key_value_heads * head_dim * kv_dtype.itemsize

    def _state_cache_settings(self, vllm_config: VllmConfig, settings: WorkerSettings) -> StateCacheSettings | None:
        """The side cache's settings when the backend turned the state cache on (and vLLM's prefix caching)."""
        if not settings.state_cache or not vllm_config.cache_config.enable_prefix_caching:
            return None
        return StateCacheSettings(vllm_config.cache_config, self.kv_bytes_per_token,
                                  vllm_config.cache_config.gpu_memory_utilization, settings.state_cache_blocks)

    @staticmethod
    def _on_gpu(wanted: bool, label: str) -> bool:
        """Whether one of the plugin's GPU-only features (its graph runners, the GDN tuning; ``label`` names it in
        the log) runs: asked for, and a CUDA device."""
        if wanted and not current_platform.is_cuda():
            log.info("clef %s: off (no CUDA device)", label)
            return False
        return wanted

    @staticmethod
    def _gemm_warmup_rows(vllm_config: VllmConfig, settings: WorkerSettings) -> int | None:
        """``--gemm-warmup``: the most rows a step gives the head's GEMMs (a step's tokens to the memory
        projection; the memory rows of the requests it finishes to the attentions), else ``None``."""
        if not settings.gemm_warmup:
            return None
        rows = max(vllm_config.scheduler_config.max_num_batched_tokens, vllm_config.model_config.max_model_len)
        if settings.gemm_warmup_rows:
            rows = min(rows, settings.gemm_warmup_rows)     # the memory plan's cap
        log.info("clef GEMM warm-up: the first step (vLLM's memory profiling) runs the head's GEMM shapes at row "
                 "counts up to %d", rows)
        return rows

    def _head_graphs(self, vllm_config: VllmConfig, settings: WorkerSettings) -> HeadGraphRunner | None:
        """The joint head's graph runner when the backend asked for it (CUDA only)."""
        if not self._on_gpu(settings.head_graphs, "head graphs"):
            return None
        runner = HeadGraphRunner(self.head, max_memory=vllm_config.model_config.max_model_len,
                                 max_records=settings.head_graph_records)
        log.info("clef head graphs: a step finishing up to %d request(s) runs the joint head from a CUDA graph "
                 "(%d buckets; memory up to %d rows)", runner.record_buckets[-1], len(runner.buckets),
                 runner.memory_buckets[-1])
        return runner

    def _install_prefill_graphs(self, vllm_config: VllmConfig, settings: WorkerSettings) -> GdnGraphRunner | None:
        """Wrap the GDN layers with :class:`GdnGraphRunner` when the backend asked for it (CUDA only)."""
        graphs = settings.prefill_graphs
        if not self._on_gpu(graphs is not None, "prefill graphs") or not triton_gdn(self.model, "prefill graphs"):
            return None
        scope = graphs.scope
        runner = GdnGraphRunner(list(graphs.buckets) or DEFAULT_BUCKETS, max_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
                                scope="core" if scope == "step" else scope)   # step graphs run the core bodies
        count = runner.install(self.model)
        log.info("clef prefill graphs: %d GDN layers, single-sequence steps of up to %d tokens replay from CUDA "
                 "graphs (buckets %s, scope %s)", count, runner.buckets[-1] if runner.buckets else 0,
                 list(runner.buckets), scope)
        return runner

    def _step_graphs(self, vllm_config: VllmConfig, settings: WorkerSettings) -> StepGraphRunner | None:
        """Whole-step graphs over the GDN runner (``--prefill-graph-scope step``: the default, through ``auto``)."""
        if self.prefill_graphs is None or not settings.step_graphs:
            return None
        runner = StepGraphRunner(self.prefill_graphs, max_len=vllm_config.model_config.max_model_len,
                                 split_seqs=settings.prefill_graphs.split)
        log.info("clef step graphs: single-sequence prefill steps padded to %s tokens replay the whole backbone "
                 "from one CUDA graph%s", list(runner.sizes),
                 f"; steps of 2-{runner.split_seqs} sequences ({SPLIT_TOKENS} tokens at most) replay each one's "
                 "graph in turn" if runner.split_seqs > 1 else "")
        return runner

    def _install_gdn_tuning(self, vllm_config: VllmConfig, settings: WorkerSettings) -> tuple[int, int, torch.dtype] | None:
        """``--gdn-tuning``: the GDN kernels' per-class autotuner caches, installed now (before vLLM's warm-up
        of them); the first forward tunes them. Returns the step budget, request limit and activation dtype
        the tuning needs, or ``None`` (off, or no CUDA device)."""
        if not self._on_gpu(settings.gdn_tuning, "GDN tuning") or not triton_gdn(self.model, "GDN tuning"):
            return None
        gdn_tuning.install()
        log.info("clef GDN tuning: %d autotuned GDN kernels keep one tuning per shape class (%s); the first forward "
                 "tunes them", len(gdn_tuning.TUNERS), ", ".join(gdn_tuning.CLASSES))
        return (vllm_config.scheduler_config.max_num_batched_tokens, vllm_config.model_config.max_model_len,
                vllm_config.model_config.dtype)

    def _tune_gdn(self, device: torch.device) -> None:
        """Once, at the first forward on the GPU outside a graph capture (vLLM's memory profiling)."""
        if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return
        budget, max_len, dtype = self._gdn_tuning
        self._gdn_tuning = None
        t0 = time.perf_counter()
        try:
            report = gdn_tuning.tune(self.model, budget, max_len, dtype, device)
        except Exception as exc:  # noqa: BLE001  (the server runs on: a kernel then tunes at its first call)
            log.warning("clef GDN tuning failed (%s: %s); a kernel without a tuning for a step's class tunes at its "
                        "first call (--gdn-tuning off keeps vLLM's)", type(exc).__name__, str(exc)[:300])
            return
        log.info("clef GDN tuning: %s in %.1f s (%s)", ", ".join(
            f"{cls} at {r['sequences']} x {r['tokens_each']} tokens" for cls, r in report.items()),
            time.perf_counter() - t0, gdn_tuning.describe())

    def _backbone(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.visual is not None:     # vLLM compiled the backbone on embeddings (its multimodal path): feed those
            return self.model(None, positions, None, self.model.embed_input_ids(input_ids))
        return self.model(input_ids, positions, None, None)

    # ------------------------------------------------------------------ vLLM model interface

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings=None, *,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        embeds = self.model.embed_input_ids(input_ids)
        self._step_media = bool(multimodal_embeddings is not None and len(multimodal_embeddings))
        if not self._step_media:
            return embeds
        return vision.merge(embeds, multimodal_embeddings, is_multimodal)

    def embed_multimodal(self, **kwargs: object):
        """Each image's features, in prompt order (the vision tower; never called when serving text only)."""
        return vision.embed_images(self.visual, kwargs)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
        """Final-norm hidden states of every scheduled token (what the head consumes)."""
        if trace.PATH is not None:
            trace.event("step_forward", trace.STEP)
        self._steps += 1
        if self._steps % GRAPH_REPORT_EVERY == 0:
            for name, runner in self.graph_runners().items():
                log.info("clef %s graphs: %s", name, runner.describe())
            if gdn_tuning.TUNERS:
                log.info("clef GDN tuning: %s", gdn_tuning.describe())
            memory.LEDGER.log_report()
        if self._gdn_tuning is not None:
            self._tune_gdn(positions.device)
        if memory.LEDGER.dirty or self._steps % memory.CHECK_EVERY_STEPS == 0:
            memory.LEDGER.settle()         # after plugin work (a capture, the GEMM warm-up), and now and then
        media, self._step_media = self._step_media, False
        if self.step_graphs is not None and intermediate_tensors is None and input_ids is not None and not media:
            # (embeddings without image features are the ids' own: the graphs start from the ids)
            out = self.step_graphs.run(self._backbone, input_ids, positions)
            if out is not None:
                return out
        if inputs_embeds is not None:
            input_ids = None
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[object]):
        """Plain positions in all three M-RoPE sections for text; the images' grids after an image's start
        (vLLM's Qwen3-VL rule, as the release's processor and model place them)."""
        return vision.mrope_positions(self.config_full, input_tokens, mm_features)

    # ------------------------------------------------------------------ weights

    def _backbone_stream(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """Checkpoint tensors for vLLM's loader; diverts lm_head and records NVFP4 global scales."""
        for name, tensor in weights:
            if name in LM_HEAD_KEYS:
                if self.files.layout == "repacked":
                    raise CheckpointError(f"{self.files.root}: {name} is in the backbone files but this "
                                          "checkpoint keeps lm_head in clef_head/tables_int8.safetensors")
                self.lm_table.weight.copy_(tensor)
                self._loaded_lm_head = True
                continue
            if name.startswith(VISION_PREFIXES) and self.visual is not None:
                yield name, tensor
                continue
            if name.startswith(NOT_TEXT_PREFIXES):
                continue
            if not name.startswith(TEXT_BACKBONE_PREFIX):
                # e.g. joint_head.safetensors picked up by a root glob (no index): loaded separately.
                continue
            if name.endswith("weight_global_scale"):
                self._global_scales[name] = tensor.detach().float().reshape(-1).cpu()
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self._loaded_lm_head = False
        loader = AutoWeightsLoader(self, skip_prefixes=["head.", "lm_table.", "pooler."])
        loaded = loader.load_weights(self._backbone_stream(weights), mapper=self.hf_to_vllm_mapper)
        loaded |= self._load_tables()
        loaded |= self._load_head()
        self._check_complete(loaded)
        self._check_fused_global_scales()
        for line in kernel_report(self):
            log.info("clef kernels in use: %s", line)
        return loaded

    def _load_tables(self) -> set[str]:
        files = self.files
        if files.layout != "repacked":
            if not self._loaded_lm_head:
                raise CheckpointError(f"{files.root}: lm_head.weight not found in the backbone files; "
                                      "the head reads lm_head rows")
            return {f"lm_table.{n}" for n, _ in self.lm_table.named_buffers()}
        if files.tables_file is None:
            raise CheckpointError(f"{files.root / 'clef_head'}: tables_int8.safetensors is missing")
        tables = load_int8_tables(files.tables_file)
        embed, lm = tables["embed_tokens"], tables["lm_head"]
        want = (self.config.vocab_size, self.config.hidden_size)
        for name, table in (("embed_tokens", embed), ("lm_head", lm)):
            if (table.num_rows, table.width) != want:
                raise CheckpointError(f"{files.tables_file}: {name} is {table.num_rows}x{table.width}, "
                                      f"expected {want[0]}x{want[1]}")
        # Both tables stay int8 with their row scales: the embedding (this rank's rows) and the lm_head.
        self.model.embed_tokens.load(embed)
        self.lm_table.weight.copy_(lm.weight)
        self.lm_table.scale.copy_(lm.scale)
        return {f"lm_table.{n}" for n, _ in self.lm_table.named_buffers()}

    def _load_head(self) -> set[str]:
        state = load_head_state(self.files, self.head.config)
        self.head.load_state_dict({k: v.to(self.head.dtype) for k, v in state.items()}, strict=True)
        return {f"head.{k}" for k in state}

    def _optional_parameters(self) -> set[str]:
        """KV-cache quantization scales (q/k/v_scale, zero points) that vLLM registers on attention
        layers of quantized models and defaults when a checkpoint has no kv_cache_scheme."""
        from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

        out = set()
        for name, module in self.named_modules():
            if isinstance(getattr(module, "quant_method", None), BaseKVCacheMethod):
                out.update(f"{name}.{p}" for p, _ in module.named_parameters(recurse=False))
        return out

    def _check_complete(self, loaded: set[str]) -> None:
        """Every parameter must have come from the checkpoint and be finite (vLLM does not track
        missing tensors for quantized checkpoints)."""
        optional = self._optional_parameters()
        missing = sorted(n for n, _ in self.named_parameters() if n not in loaded and n not in optional)
        if missing:
            raise CheckpointError(f"{self.files.root}: {len(missing)} tensor(s) expected by the model were not in "
                                  f"the checkpoint, e.g. {missing[:6]}")
        bad = [n for n, p in list(self.named_parameters()) + list(self.named_buffers()) if not _all_finite(p.data)]
        if bad:
            raise CheckpointError(f"{self.files.root}: non-finite values in {bad[:6]}")

    def _check_fused_global_scales(self) -> None:
        """NVFP4 shards fused into one vLLM module must share one weight global scale: vLLM keeps
        the max divisor and silently mis-scales the other shards (clef_vllm.quant.fused_scales)."""
        unequal = [g for g in fused_global_scales(self._global_scales) if not g.weight_ok]
        if unequal:
            first = unequal[0]
            raise CheckpointError(
                f"{self.files.root}: NVFP4 shards of {len(unequal)} fused module(s) have different weight global "
                f"scales (e.g. {first.describe()}); vLLM would silently mis-scale them. Re-export with shared "
                "scales or fix the checkpoint: clef-load DIR --fix-fused-scales --out FIXED_DIR")


__all__ = ["ClefFlashForDecision"]
