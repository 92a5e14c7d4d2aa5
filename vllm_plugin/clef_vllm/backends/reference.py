"""Reference backend: the Qwen3.5 text backbone through transformers, on CPU or CUDA.

It reproduces what the release runs for text-only batches (docs/encoding-and-head.md, "The
backbone"): the bare ``Qwen3_5TextModel`` with ``use_cache=False``, right-padded batches with an
attention mask, the final-norm hidden state of every position, then the shared joint head. Like
the release's loader, ``dtype`` applies to the backbone and the head (``head_dtype`` overrides
the head's alone). Options: :class:`clef_vllm.backends.options.ReferenceOptions`.

With ``state_cache`` on, a request whose state (the prompt before its schema) is at least
``MIN_REUSE_TOKENS`` long runs in two passes: the state, whose transformers cache (the attention
layers' K/V, the GDN layers' conv and recurrent states) and final hidden states are kept under a
digest of its token ids (:class:`StateStore`, least recently used first out past ``state_cache_mb``),
then the rest of the prompt continuing from a copy of that cache. A later request about the same
state runs only the second pass. The split changes the order of the float sums (GDN chunks start
at the state's end): float32 answers equal one pass within 1e-5 (tests/test_reference.py).
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from clef_vllm.backends.base import Backend, MicroBatcher, measure_stage, parse_dtype
from clef_vllm.backends.options import ReferenceOptions, backend_options
from clef_vllm.model.checkpoint import (CheckpointError, CheckpointFiles, iter_backbone_tensors, load_head,
                                  locate_checkpoint)
from clef_vllm.model.features import HeadSpec, RecordAccumulator, accumulate, decide_records
from clef_vllm.model.layout import BACKBONE_PREFIXES, LM_HEAD_KEYS, NOT_TEXT_PREFIXES, VISION_PREFIXES
from clef_vllm.model.tables import DenseTable, LexicalTable, load_int8_tables
from clef_vllm.schema.encoding import EncodedRequest, RequestEncoder
from clef_vllm.schema.media import media_refused
from clef_vllm.schema.state_keys import MIN_REUSE_TOKENS, prefix_digest
from clef_vllm.util.lru import SizedLRU

log = logging.getLogger("clef_vllm")


def text_config_from(files: CheckpointFiles):
    """The transformers ``Qwen3_5TextConfig`` of a checkpoint (VL or text-only config.json)."""
    from transformers import Qwen3_5TextConfig

    cfg = dict(files.text_config)
    cfg.pop("quantization_config", None)
    cfg.setdefault("model_type", "qwen3_5_text")
    return Qwen3_5TextConfig.from_dict(cfg)


def load_text_backbone(files: CheckpointFiles, device: torch.device, dtype=torch.bfloat16,
                       vision: dict | None = None):
    """``(Qwen3_5TextModel, lm_head table)`` loaded strictly from either checkpoint layout. A dict given as
    ``vision`` receives the vision tower's tensors (``model.visual.*``, names without that prefix)."""
    from transformers import Qwen3_5TextModel

    if files.quantization_config is not None:
        raise CheckpointError(f"{files.root / 'config.json'}: quantized backbone "
                              f"({files.quantization_config.get('quant_method')}); the reference backend runs "
                              "16-bit backbones only. Use --backend vllm on a GPU.")
    config = text_config_from(files)
    config._attn_implementation = "sdpa"
    state: dict[str, torch.Tensor] = {}
    lm_head = None
    for name, tensor in iter_backbone_tensors(files, device=device, check_values=True):
        if name in LM_HEAD_KEYS:
            lm_head = tensor
            continue
        if name.startswith(NOT_TEXT_PREFIXES):
            if vision is not None and name.startswith(VISION_PREFIXES):
                vision[name.split("visual.", 1)[1]] = tensor
            continue
        for prefix in BACKBONE_PREFIXES:
            if name.startswith(prefix):
                state[name[len(prefix):]] = tensor
                break
    if files.tables_file is not None:
        tables = load_int8_tables(files.tables_file, device=device)
        if "embed_tokens.weight" in state or lm_head is not None:
            raise CheckpointError(f"{files.root}: embed_tokens / lm_head are both in the backbone files and in "
                                  f"{files.tables_file}; a repacked checkpoint keeps them in the tables only")
        state["embed_tokens.weight"] = tables["embed_tokens"].dequantize(dtype)
        lm_table: LexicalTable = tables["lm_head"]
    else:
        if lm_head is None:
            raise CheckpointError(f"{files.root}: lm_head.weight not found in the backbone files and no "
                                  "clef_head/tables_int8.safetensors; the head reads lm_head rows")
        lm_table = DenseTable(lm_head)
    model = _construct(lambda: Qwen3_5TextModel(config), device, dtype)
    _load_strictly(model, state, files, "backbone tensors")
    vocab = config.vocab_size
    if lm_table.num_rows != vocab or lm_table.width != config.hidden_size:
        raise CheckpointError(f"{files.root}: lm_head table is {lm_table.num_rows}x{lm_table.width}, "
                              f"expected {vocab}x{config.hidden_size}")
    return model.eval().requires_grad_(False), lm_table


def _construct(make, device, dtype):
    """``make()`` with its parameters created on ``device`` in ``dtype``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return make()
    finally:
        torch.set_default_dtype(previous)


def _load_strictly(module, state: dict, files: CheckpointFiles, what: str) -> None:
    result = module.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(f"{files.root}: {what} do not match config.json: "
                              f"missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}")


def load_multimodal_backbone(files: CheckpointFiles, text_model, vision_state: dict, device: torch.device,
                             dtype=torch.bfloat16):
    """transformers' ``Qwen3_5Model`` (the vision tower, the merger into the text model's embeddings, M-RoPE
    positions from the image grids) around an already loaded text model: what the release runs for a batch
    with media. The vision tower is loaded strictly from ``vision_state``."""
    from transformers import Qwen3_5Config, Qwen3_5Model, Qwen3_5VisionModel

    cfg = {k: v for k, v in files.config.items() if k != "quantization_config"}
    config = Qwen3_5Config.from_dict(cfg)
    config.vision_config._attn_implementation = "sdpa"
    vision = _construct(lambda: Qwen3_5VisionModel(config.vision_config), device, dtype)
    model = _construct(lambda: Qwen3_5Model(config), "meta", dtype)      # its parts are replaced below
    _load_strictly(vision, vision_state, files, "vision tensors (model.visual.*)")
    model.visual = vision.eval().requires_grad_(False)
    model.language_model = text_model
    return model.eval()


def tensor_bytes(obj: Any, seen: set | None = None) -> int:
    """Bytes of the tensors an object holds (attributes, lists, tuples, dicts; each tensor once)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__"):
        return sum(tensor_bytes(v, seen) for v in vars(obj).values())
    return 0


class StateStore(SizedLRU):
    """Kept states by digest: ``(transformers cache, final hidden states [1, P, H])``, least recently used
    first out once their tensors' bytes pass ``capacity`` (a state larger than that is not kept)."""

    def put(self, key: bytes, cache, hidden: torch.Tensor) -> bool:
        return super().put(key, (cache, hidden), tensor_bytes(cache) + tensor_bytes(hidden))

    def describe(self) -> dict:
        return {"states": len(self), "bytes": self.size, "capacity_bytes": self.capacity, "hits": self.hits,
                "misses": self.misses, "evicted": self.evicted}


class ReferenceBackend(Backend):
    """transformers backbone + shared head; batches requests by length with right padding."""

    name = "reference"

    def __init__(self, model_dir: str | Path, options: ReferenceOptions | None = None, *,
                 encoder: RequestEncoder | None = None, **kwargs):
        """``options`` (or the same as keyword arguments): :class:`~clef_vllm.backends.options.ReferenceOptions`."""
        self.options = opts = options if options is not None else backend_options("reference", kwargs)
        self.files = locate_checkpoint(model_dir)
        self.device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cpu":
            _quiet_kernel_fallback_warnings()
            torch.set_num_threads(cpu_threads(opts.threads))
        self.dtype = parse_dtype(opts.dtype)
        self.head_dtype = parse_dtype(opts.resolved_head_dtype)
        self.max_model_len = opts.max_model_len
        self.max_batch_size = opts.max_batch_size
        self.max_batch_tokens = max(opts.max_batch_tokens, self.max_model_len)
        self.head = load_head(self.files, dtype=self.head_dtype, device=self.device)
        vision: dict | None = None if opts.text_only or "vision_config" not in self.files.config else {}
        self.model, self.lm_table = load_text_backbone(self.files, self.device, self.dtype, vision=vision)
        # the model's cache argument and output: transformers 5.24 renamed ``past_key_values`` to ``cache``
        self._cache_name = "cache" if "cache" in inspect.signature(self.model.forward).parameters \
            else "past_key_values"
        self.lm_table.to(self.device)
        self.multimodal = None               # Qwen3_5Model around self.model, for requests with images
        if vision:
            self.multimodal = load_multimodal_backbone(self.files, self.model, vision, self.device, self.dtype)
        refusal = ("the server runs with --text-only" if opts.text_only else
                   None if self.multimodal is not None else "the checkpoint has no vision tower")
        self.encoder = encoder or _load_encoder(self.files, self.max_model_len, refusal)
        pad = self.model.config.pad_token_id
        self.pad_id = 0 if pad is None else int(pad)
        self._batcher: MicroBatcher | None = None
        self.states = StateStore(opts.state_cache_mb * 2 ** 20) if opts.state_cache else None
        log.info("reference backend: %s layout on %s, backbone %s, head %s (transformers %s)%s", self.files.layout,
                 self.device, _dtype_name(self.dtype), _dtype_name(self.head_dtype), _tf_version(),
                 "; GDN and conv1d run transformers' reference PyTorch kernels (correct, slower; the fast ones need "
                 "CUDA)" if self.device.type == "cpu" else "")

    def describe(self) -> dict:
        return {"backend": self.name, "device": str(self.device), "layout": self.files.layout,
                "dtype": _dtype_name(self.dtype), "head_dtype": _dtype_name(self.head_dtype),
                "quantization": None,    # quantized checkpoints are refused at load
                "kernels": {"unquantized": sum(isinstance(m, torch.nn.Linear) for m in self.model.modules())},
                "transformers": _tf_version(), "max_model_len": self.max_model_len,
                "max_batch_size": self.max_batch_size,
                "cpu_threads": torch.get_num_threads() if self.device.type == "cpu" else None,
                "compute_nice": self.options.compute_nice if self.device.type == "cpu" else 0,
                "state_cache": None if self.states is None else self.states.describe(),
                "images": None if self.encoder.media is None else self.encoder.media.describe()}

    def _batches(self, encoded: Sequence[EncodedRequest]) -> list[list[int]]:
        order = sorted(range(len(encoded)), key=lambda i: encoded[i].num_tokens)
        batches, cur = [], []
        for i in order:
            longest = encoded[i].num_tokens  # sorted ascending: the newest is the longest
            if cur and (len(cur) >= self.max_batch_size or longest * (len(cur) + 1) > self.max_batch_tokens):
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
        return batches

    @torch.inference_mode()
    def hidden_states(self, encoded: Sequence[EncodedRequest]) -> torch.Tensor:
        """Final-norm hidden states ``[B, Lmax, H]`` of a right-padded batch (the reference forward)."""
        longest = max(e.num_tokens for e in encoded)
        ids = torch.full((len(encoded), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(encoded), longest), dtype=torch.long)
        for b, e in enumerate(encoded):
            ids[b, : e.num_tokens] = torch.tensor(e.input_ids)
            mask[b, : e.num_tokens] = 1
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)
        return out.last_hidden_state

    def _reuses(self, e: EncodedRequest) -> bool:
        return self.states is not None and e.schema_offset >= MIN_REUSE_TOKENS and e.media is None

    @torch.inference_mode()
    def hidden_with_media(self, e: EncodedRequest) -> torch.Tensor:
        """Final-norm hidden states ``[1, L, H]`` of one request with images or videos: the release's multimodal
        forward (the vision tower's features in place of the pad tokens, M-RoPE positions from the grids)."""
        if self.multimodal is None:
            raise media_refused(self.encoder.text_only)
        ids = torch.tensor([e.input_ids], dtype=torch.long, device=self.device)
        config = self.multimodal.config
        types = (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()
        tensors = {}
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
            value = getattr(e.media, key)
            if value is not None:
                tensors[key] = value.to(self.device)
        out = self.multimodal(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                              mm_token_type_ids=types, **tensors)
        return out.last_hidden_state

    @torch.inference_mode()
    def hidden_reusing_state(self, e: EncodedRequest) -> tuple[torch.Tensor, int]:
        """Final-norm hidden states ``[1, L, H]`` of one request whose state may be kept (module docstring),
        and how many leading tokens came from a kept state."""
        ids = torch.tensor(e.input_ids, dtype=torch.long, device=self.device).unsqueeze(0)
        p = e.schema_offset
        key = prefix_digest(e.input_ids, p)
        kept = self.states.get(key)
        cached = p if kept is not None else 0
        name = self._cache_name
        if kept is None:
            out = self.model(input_ids=ids[:, :p], use_cache=True)
            cache, state_hidden = getattr(out, name), out.last_hidden_state
            if self.states.put(key, cache, state_hidden):
                cache = copy.deepcopy(cache)         # the rest of the prompt extends a copy; the kept one stays
        else:
            cache, state_hidden = kept
            cache = copy.deepcopy(cache)
        rest = self.model(input_ids=ids[:, p:], use_cache=True, **{name: cache})
        return torch.cat([state_hidden, rest.last_hidden_state], dim=1), cached

    @torch.inference_mode()
    def decide_batch(self, encoded: Sequence[EncodedRequest]) -> list[torch.Tensor]:
        results: list[torch.Tensor | None] = [None] * len(encoded)
        reusing = [self._reuses(e) for e in encoded]
        for i in (i for i, e in enumerate(encoded) if e.media is not None):     # one at a time: images differ
            with measure_stage("backbone"):
                hidden = self.hidden_with_media(encoded[i])
            results[i] = self._decide_hidden(hidden, [encoded[i]])[0]
        plain = [i for i, r in enumerate(reusing) if not r and encoded[i].media is None]
        for i in (i for i, r in enumerate(reusing) if r):                  # one at a time: prompts differ
            with measure_stage("backbone"):
                hidden, encoded[i].cached_state_tokens = self.hidden_reusing_state(encoded[i])
            results[i] = self._decide_hidden(hidden, [encoded[i]])[0]
        for group in self._batches([encoded[i] for i in plain]):
            group = [plain[j] for j in group]
            with measure_stage("backbone"):
                hidden = self.hidden_states([encoded[i] for i in group])
            for i, probs in zip(group, self._decide_hidden(hidden, [encoded[i] for i in group])):
                results[i] = probs
        return results

    def _decide_hidden(self, hidden: torch.Tensor, encoded: Sequence[EncodedRequest]) -> list[torch.Tensor]:
        """The head's probabilities for the requests whose hidden states are the rows of ``hidden``
        (``[B, Lmax, H]``, right-padded)."""
        accs = [RecordAccumulator(HeadSpec.from_encoded(e)) for e in encoded]
        longest = hidden.shape[1]
        flat = hidden.reshape(-1, hidden.shape[-1])
        accumulate(self.head, flat, [(acc, b * longest, acc.spec.num_tokens, 0) for b, acc in enumerate(accs)])
        return [probs.cpu() for probs in decide_records(self.head, self.lm_table, accs)]

    async def decide(self, encoded: EncodedRequest) -> torch.Tensor:
        if self._batcher is None:
            self._batcher = MicroBatcher(self.decide_batch, self.max_batch_size, self.max_batch_tokens,
                                         nice=self.options.compute_nice if self.device.type == "cpu" else 0)
        return await self._batcher.submit(encoded)

    def close(self) -> None:
        if self._batcher is not None:
            self._batcher.close()
            self._batcher = None


def cpu_threads(asked: int | None = None, environ=None) -> int:
    """torch's threads for forward passes on a CPU: ``asked``; else ``OMP_NUM_THREADS`` (torch's own count, read
    from it) when the environment sets it; else every core this process may use but one, at least one and at most
    torch's default. The core left runs the event loop, the CPU pool and the tokenizer. An OpenMP team meets at each
    parallel op and its waiting members spin: when one is preempted (by the server's own threads or anything else on
    the machine) the others burn the cores it needs (docs/operating.md, "Forward passes on a CPU")."""
    environ = os.environ if environ is None else environ
    if asked:
        return asked
    if environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), cores - 1))


def _load_encoder(files: CheckpointFiles, max_length: int, images: str | None = None) -> RequestEncoder:
    """The checkpoint's tokenizer (and image processor, unless ``images`` says why not) as a request encoder; a
    broken tokenizer names the files."""
    try:
        return RequestEncoder.from_pretrained(files.root, max_length=max_length, images=images)
    except Exception as exc:  # noqa: BLE001 - transformers raises several types for missing or corrupt files
        raise CheckpointError(f"{files.root}: cannot load the tokenizer (tokenizer.json, tokenizer_config.json): "
                              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from None


def _quiet_kernel_fallback_warnings() -> None:
    """On CPU, transformers warns once per kernel that the GDN / causal-conv1d fast kernels (CUDA-only
    packages) are missing and it falls back to PyTorch: expected there, so said once in our own
    start-up line instead (on CUDA the warning stays: installing them helps)."""
    import logging as std_logging

    std_logging.getLogger("transformers.integrations.hub_kernels").setLevel(std_logging.ERROR)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tf_version() -> str:
    import transformers

    return transformers.__version__
