"""The worker's memory budget: everything the engine's process holds stays inside ``--gpu-memory-utilization``.

vLLM 0.28 sizes the KV cache as the budget (``gpu_memory_utilization`` x the device) less what its
profiling run measured: the weights, the peak of one step's activations (the plugin's head, its GEMM
warm-up and the state cache's side rows run inside that profiling) and its own CUDA graphs' estimate.
In that profiling step vLLM's GDN layers skip their core; :class:`ClefWorker` has one of them run it at the
step's full size (:mod:`clef_vllm.worker.gdn_profile`), so that the peak vLLM measures holds the prefill's
convolution, chunk intermediates and recurrent states too.
Some things are not in that sum, and :class:`ClefWorker` takes them out of the KV cache explicitly:

* what a served step holds beyond vLLM's profiling step (measured; per batched token), and the head's memory
  rows of the requests mid-prefill (a row per token they hold; kept until their decision);
* the CUDA context and what the device held for this process before vLLM's first snapshot (vLLM
  measures from there, so by its count the context comes on top of the budget), and room for the memory
  outside PyTorch that later graph captures add;
* the plugin's own CUDA graphs and their buffers (the step, GDN and head graphs), captured after the
  KV cache exists: :func:`plugin_graph_bytes` estimates them from the settings the worker got
  (:mod:`clef_vllm.plan.graph_costs` holds the per-feature figures), and what vLLM's own graphs hold
  beyond vLLM's estimate of them (measured ~40 % more);
* and, once the engine is warm, the caching allocator is capped at what the budget leaves beside
  the non-PyTorch memory (``torch.cuda.set_per_process_memory_fraction``): under load the allocator
  frees its cached blocks instead of growing past the budget (it grew ~9 GiB beyond it on a 9B engine
  at 64 concurrent requests otherwise).

A plugin graph that would not fit then fails its capture and that feature runs eagerly (each runner
logs it once); the process never holds more than the budget.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from vllm.v1.worker.gpu_worker import Worker

from clef_vllm.contract import WorkerSettings
from clef_vllm.plan.graph_costs import graph_reservation
from clef_vllm.plan.memory_plan import (CUDA_CONTEXT_BYTES, NON_TORCH_GROWTH_BYTES, VLLM_GRAPH_UNDERCOUNT,
                                        served_step_excess)
from clef_vllm.worker import memory
from clef_vllm.worker.gdn_profile import GdnPeakProbe

log = logging.getLogger("clef_vllm")

GIB = float(1 << 30)
#: Kept free under the allocator's cap (and out of the KV cache) for memory outside PyTorch that comes after the
#: cap is set: CUDA graph executables, the workspaces of graph captures.
CAP_MARGIN_BYTES = NON_TORCH_GROWTH_BYTES
#: The CUDA context where the driver cannot say what this process holds (NVML lists no process here).
DEFAULT_CONTEXT_BYTES = CUDA_CONTEXT_BYTES


class MemoryBudgetError(RuntimeError):
    """The budget leaves the KV cache nothing once the plugin's needs are taken out."""


def process_memory() -> int | None:
    """This process's memory on its device by the driver's count, or ``None`` (:mod:`clef_vllm.worker.memory`)."""
    return memory.process_used()


def outside_allocator() -> int:
    """What this process holds on the device outside PyTorch's allocator now (the CUDA context, libraries'
    workspaces): the driver's count less the allocator's reservations, or :data:`DEFAULT_CONTEXT_BYTES`."""
    used = process_memory()
    if used is None:
        return DEFAULT_CONTEXT_BYTES
    return max(0, used - int(torch.cuda.memory_reserved()))


def plugin_graph_bytes(vllm_config) -> dict[str, int]:
    """The plugin's CUDA graphs this worker will capture after the KV cache exists, by kind, in bytes (the
    settings the backend gave it; :func:`clef_vllm.plan.graph_costs.graph_reservation` holds the figures)."""
    if not torch.cuda.is_available():
        return {}
    settings = WorkerSettings.of(vllm_config)
    config = vllm_config.model_config.hf_text_config
    return graph_reservation(
        hidden=config.hidden_size, intermediate=config.intermediate_size,
        head_records=settings.head_graph_records,
        prefill_buckets=list(settings.prefill_graphs.buckets) if settings.prefill_graphs else [],
        step_graphs=settings.step_graphs)


def runtime_excess_bytes(vllm_config) -> int:
    """What a served step holds beyond vLLM's profiling step (:data:`clef_vllm.plan.memory_plan.RUNTIME_EXCESS_BYTES_PER_TOKEN`
    per batched token, scaled by hidden + intermediate size)."""
    text = vllm_config.model_config.hf_text_config
    return served_step_excess(text.hidden_size, text.intermediate_size,
                              vllm_config.scheduler_config.max_num_batched_tokens)


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


class ClefWorker(Worker):
    """vLLM's GPU worker, with the plugin's memory taken out of the KV cache and the allocator capped."""

    def _context_bytes(self) -> int:
        """What this process held before vLLM's first memory snapshot (the CUDA context and its modules): the
        driver's count now less what vLLM measured since (``total_consumed``), else the plan's figure."""
        used, consumed = process_memory(), getattr(self, "total_consumed", None)
        if used is None or consumed is None:
            return DEFAULT_CONTEXT_BYTES
        return max(0, used - int(consumed))

    def _peak_probe(self) -> GdnPeakProbe | None:
        """The GDN prefill probe on this worker's model (``None`` without a GPU or GDN layers)."""
        runner = self.model_runner
        if not torch.cuda.is_available():
            return None
        probe = GdnPeakProbe(runner.max_num_tokens, runner.max_num_reqs)
        return probe if probe.install(runner.get_model()) else None

    def _in_flight_rows(self, room: int) -> int:
        """The head's memory rows of the requests mid-prefill (one row per token they hold in the KV cache, kept
        until their decision): the share of ``room`` that covers every token the rest of it can hold."""
        model = self.model_runner.get_model()
        head, per_token = getattr(model, "head", None), getattr(model, "kv_bytes_per_token", None)
        if head is None or not per_token or room <= 0:
            return 0
        from clef_vllm.worker.fast.state_cache import side_share

        return int(room * side_share(head.config.width, head.dtype, per_token))

    def determine_available_memory(self) -> int:
        probe = self._peak_probe()
        with probe.armed_for_profiling() if probe is not None else contextlib.nullcontext():
            available = super().determine_available_memory()
        if probe is not None and not probe.runs:
            log.warning("clef memory budget: vLLM's profiling step never reached a GDN layer at its %d tokens: the KV "
                        "cache is sized without the GDN prefill's memory", probe.tokens)
        keep = {"CUDA context": self._context_bytes(), "later non-torch memory": CAP_MARGIN_BYTES,
                "vLLM's graphs beyond its estimate": int(VLLM_GRAPH_UNDERCOUNT
                                                         * getattr(self, "cudagraph_memory_estimate", 0))}
        keep["a served step beyond the profile"] = runtime_excess_bytes(self.vllm_config)
        keep.update(plugin_graph_bytes(self.vllm_config))
        keep["memory rows in flight"] = self._in_flight_rows(available - sum(keep.values()))
        kv = int(available - sum(keep.values()))
        parts = ", ".join(f"{name} {gib(n)}" for name, n in keep.items() if n)
        if kv <= 0:
            raise MemoryBudgetError(
                f"clef memory budget: vLLM left {gib(available)} for the KV cache and the plugin needs "
                f"{gib(sum(keep.values()))} of it ({parts}): nothing is left. Free memory with a shorter "
                "--max-model-len or --max-num-batched-tokens, --head-graphs off, --prefill-graphs off, "
                "--nvfp4-kernel vllm, or a larger --gpu-memory-utilization")
        log.info("clef memory budget: vLLM's KV cache %s less what its profiling does not count (%s): KV cache %s",
                 gib(available), parts, gib(kv))
        memory.LEDGER.reserved_for_graphs = sum(n for name, n in keep.items() if name.endswith("graphs"))
        return kv

    def compile_or_warm_up_model(self):
        out = super().compile_or_warm_up_model()
        if torch.cuda.is_available():
            cap_allocator(int(self.requested_memory))
        return out


def cap_allocator(budget_bytes: int, device=None) -> float:
    """Cap PyTorch's caching allocator so that it and this process's non-PyTorch memory stay within
    ``budget_bytes``; returns the fraction set."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    total = int(torch.cuda.get_device_properties(device).total_memory)
    outside = outside_allocator()
    cap = max(budget_bytes - outside - CAP_MARGIN_BYTES, int(torch.cuda.memory_reserved(device)))
    fraction = min(cap / total, 1.0)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    log.info("clef memory budget: PyTorch's allocator capped at %s (the budget %s less %s outside it and %s "
             "kept free); it frees cached blocks rather than grow past it", gib(cap), gib(budget_bytes),
             gib(outside), gib(CAP_MARGIN_BYTES))
    return fraction
