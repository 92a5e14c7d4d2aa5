"""The raw-backbone baseline: vLLM ``embed`` pooling of the very same token ids, in-process.

No head, no HTTP, no JSON: an ``AsyncLLM`` engine on the same checkpoint receives each request's
encoded ids (in vLLM's rendered token form, as the server sends them) and returns one pooled
vector. It is driven by the same closed loop at the same concurrencies as the server, so
``server tok/s ÷ raw tok/s`` is the fraction of the backbone's throughput the whole server delivers.

vLLM is imported only inside :meth:`RawVllmEngine.start`, so this module is safe to import on CPU.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from pathlib import Path
from typing import Any

from clef_vllm.bench.loadgen import Outcome
from clef_vllm.bench.workloads import BenchRequest

#: Architectures vLLM can run as a plain Qwen3.5 backbone; anything else (e.g. our own
#: ``ClefFlashForDecision`` in repacked checkpoints) is overridden to the text-only class.
STOCK_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")
TEXT_ARCHITECTURE = "Qwen3_5ForCausalLM"


def parse_engine_arg(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE parsed as JSON when it is JSON (``true``, ``0.8``, ``{"a":1}``), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"engine argument must look like KEY=VALUE, got {text!r}")
    try:
        return key.replace("-", "_"), json.loads(value)
    except json.JSONDecodeError:
        return key.replace("-", "_"), value


def raw_engine_kwargs(model_dir: str | Path, *, arch: str = "auto", load_format: str = "auto",
                      max_model_len: int = 16384, gpu_memory_utilization: float = 0.9, enforce_eager: bool = False,
                      max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                      quantization: str | None = None, linear_backend: str | None = None,
                      extra: dict | None = None) -> dict:
    """``AsyncEngineArgs`` keyword arguments for the baseline (pure data; no vLLM import).

    They start from the server's own vLLM settings (:func:`clef_vllm.backends.vllm_backend.engine_kwargs`:
    chunked prefill, fp32 SSM cache, Triton GDN prefill, the same batch limits, the same scheduler class
    with its fixes for pooling engines but no batch wait) without the plugin's own engine features (no
    prefill graphs, vLLM's default CUDA-graph sizes, no state cache: prefix caching off) and change only
    what makes it a bare backbone: ``convert="embed"`` with last-token pooling, no
    head options, vLLM's own worker class (the plugin's keeps its own memory out of the KV cache), and the
    architecture. ``arch="auto"`` keeps a stock Qwen3.5 architecture and
    otherwise (our ``ClefFlashForDecision``) uses ``Qwen3_5ForCausalLM``; ``"none"`` keeps whatever
    config.json declares. ``load_format="auto"`` becomes ``dummy`` (``clef-dummy`` for a quantized
    layout) for a repacked checkpoint (its embedding and lm_head live in ``clef_head/`` int8 tables that
    a stock class cannot load) and for a config-only folder (the 9B-shaped benchmark checkpoints);
    throughput does not depend on weight values.
    """
    from clef_vllm.backends.vllm_backend import engine_kwargs
    from clef_vllm.worker.dummy_loader import dummy_format_for

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    declared = (config.get("architectures") or [None])[0]
    if arch == "auto":
        arch = None if declared in STOCK_ARCHITECTURES else TEXT_ARCHITECTURE
    elif arch == "none":
        arch = None
    effective = arch or declared or ""
    if load_format == "auto" and ((model_dir / "clef_head").is_dir() or not any(model_dir.glob("*.safetensors"))):
        load_format = dummy_format_for(config)     # a quantized layout's scales tame (worker/dummy_loader.py)
    limits = {k: v for k, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens))
              if v is not None}
    kwargs = engine_kwargs(model_dir, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                           enforce_eager=enforce_eager, load_format=load_format, gdn_prefill_backend="triton",
                           linear_backend=linear_backend, prefill_graphs=False, state_cache=False, **limits)
    kwargs.pop("additional_config", None)   # the Clef head's options
    kwargs.pop("worker_cls", None)          # vLLM's own worker: the plugin's memory budget is the server's
    kwargs.pop("hf_overrides", None)        # the server's ClefFlashForDecision
    kwargs["convert"] = "embed"
    kwargs["pooler_config"] = {"seq_pooling_type": "LAST"}
    if arch is not None:
        kwargs["hf_overrides"] = {"architectures": [arch]}
    if effective.endswith("ForConditionalGeneration"):
        kwargs["language_model_only"] = True      # text only: no vision tower, no image profiling
    if kwargs.get("language_model_only") or not effective.endswith("ForConditionalGeneration"):
        kwargs["skip_tokenizer_init"] = True      # token ids only: no image processor needs the tokenizer
    if quantization:
        kwargs["quantization"] = quantization
    kwargs.update(extra or {})
    return kwargs


class RawVllmEngine:
    """An in-process ``AsyncLLM`` pooling engine; :meth:`send` has the HTTP sender's signature."""

    def __init__(self, engine_kwargs: dict):
        self.engine_kwargs = dict(engine_kwargs)
        self.engine = None
        self.start_s: float | None = None
        self._ids = itertools.count()
        self._params = None
        self._prompt = None
        self._profile = None        # CLEF_VLLM_PROFILE, as the server's (its window counts every request sent)

    async def start(self) -> None:
        """Build the engine (minutes on a cold GPU machine). Must run inside the event loop."""
        from vllm import AsyncEngineArgs, PoolingParams
        from vllm.config import PoolerConfig
        from vllm.v1.engine.async_llm import AsyncLLM

        from clef_vllm.backends.vllm_backend import engine_input
        from clef_vllm.util import trace

        kwargs = dict(self.engine_kwargs)
        if isinstance(kwargs.get("pooler_config"), dict):
            kwargs["pooler_config"] = PoolerConfig(**kwargs["pooler_config"])
        self._profile = trace.ProfileWindow.from_env()
        if self._profile is not None:
            from vllm.config import ProfilerConfig

            kwargs["profiler_config"] = ProfilerConfig(**self._profile.profiler_config())
        t0 = time.perf_counter()
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        self.start_s = time.perf_counter() - t0
        self._params = PoolingParams(task="embed")
        self._prompt = engine_input         # the same rendered form as the server's

    def describe(self) -> dict:
        info: dict[str, Any] = {"engine_kwargs": self.engine_kwargs, "engine_start_s": self.start_s}
        try:
            import vllm

            info["vllm_version"] = vllm.__version__
        except Exception:  # noqa: BLE001 - informational only
            pass
        return info

    async def send(self, req: BenchRequest) -> Outcome:
        if req.input_ids is None:
            return Outcome("not_encodable", 0.0, error=f"expected HTTP {req.expected_status}; nothing to embed")
        prompt = self._prompt(req.input_ids.tolist())
        profiled = contextlib.nullcontext() if self._profile is None else self._profile.around(self.engine)
        async with profiled:
            t0 = time.perf_counter()
            final = None
            try:
                async for out in self.engine.encode(prompt, self._params, request_id=f"raw-{next(self._ids)}"):
                    final = out
            except Exception as exc:  # noqa: BLE001 - counted as an error of this point
                return Outcome("engine_error", time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}"[:300])
        latency = time.perf_counter() - t0
        if final is None:
            return Outcome("engine_error", latency, error="no output")
        return Outcome("200", latency, input_tokens=len(final.prompt_token_ids))

    async def finish_profile(self) -> None:
        """A CLEF_VLLM_PROFILE window the run left open is stopped, so its trace is still written."""
        if self._profile is not None and self.engine is not None:
            await self._profile.finish(self.engine)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
