"""The memory plan at the vLLM backend's start: settings that fit the GPU, or a clear refusal.

Before the engine starts, :func:`fit_options` computes the checkpoint's memory plan
(:mod:`clef_vllm.plan.memory_plan`) for the first visible GPU's memory (read with NVML: the plan
itself makes no CUDA context) and the budget ``--gpu-memory-utilization`` gives each engine, then:

* resolves ``--nvfp4-kernel auto`` by memory as well as speed (BF16 dequantized weights only where
  the KV cache keeps room for a few ``--max-model-len`` sequences; the packed kernel otherwise);
* turns the plugin's memory-costly features down or off where the KV cache would be too small,
  one log line per change saying what and why;
* refuses a plan that cannot hold one sequence with :class:`~clef_vllm.plan.memory_plan.PlanDoesNotFit`,
  whose message names the biggest consumers and the flags that free memory (the server prints it
  and exits 1, before loading anything).

:func:`plan_for_checkpoint` is the same plan for any device size (``clef-load --gpu-memory``).

The plan is logged (``clef memory plan: ...``); the worker's ``clef memory budget: ...`` line then says
what vLLM measured, for comparison.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from clef_vllm.backends.options import VllmOptions, flag_of
from clef_vllm.plan.memory_plan import (MIN_BF16_SEQUENCES, MIN_SEQUENCES, MemoryPlan, PlanInputs, choose_nvfp4_kernel,
                                        fit, gib, model_shape_for_checkpoint)
from clef_vllm.quant.kernels import resolve_nvfp4_kernel

log = logging.getLogger("clef_vllm")


def device_memory() -> tuple[int, tuple[int, int]] | None:
    """``(total bytes, compute capability)`` of the first visible CUDA GPU, or ``None`` without one (or where
    NVML cannot tell). The total is what CUDA reports, which vLLM's budget is a share of: NVML's total less
    the driver's reservations (about 0.5 GiB of an H100's 80 GB), NVML's total where it cannot say those."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cuda():
            return None
        capability = current_platform.get_device_capability(0)
        total = int(current_platform.get_device_total_memory(0))
    except Exception:  # noqa: BLE001 - no plan without the device's size: the engine's own sizing still holds
        return None
    try:
        from vllm.third_party import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(current_platform.device_id_to_physical_device_id(0))
            info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            total = int(info.total) - int(info.reserved)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - an older driver without the v2 query: NVML's total (0.6 % high on an H100)
        pass
    return total, (capability.major, capability.minor)


def options_for(opts: VllmOptions, inputs: PlanInputs) -> VllmOptions:
    """``opts`` with the plan's resolved NVFP4 kernel and feature settings."""
    given = PlanInputs.from_options(opts, inputs.budget_bytes)
    changes: dict = {}
    if opts.nvfp4_kernel == "auto" and not opts.linear_backend_chosen:
        changes["nvfp4_kernel"] = inputs.nvfp4_kernel
    if inputs.head_graph_records != given.head_graph_records:
        changes.update(head_graphs=inputs.head_graph_records > 0,
                       head_graph_records=inputs.head_graph_records or opts.head_graph_records)
    if inputs.max_num_batched_tokens != given.max_num_batched_tokens:
        changes.update(max_num_batched_tokens=inputs.max_num_batched_tokens)
    if inputs.max_num_seqs != given.max_num_seqs:
        changes.update(max_num_seqs=inputs.max_num_seqs)
    if given.prefill_graphs and not inputs.prefill_graphs:
        changes.update(prefill_graphs=False)
    elif inputs.prefill_max_bucket < given.prefill_max_bucket:
        from clef_vllm.worker.fast.prefill_graphs import DEFAULT_BUCKETS

        changes.update(prefill_graph_buckets=tuple(b for b in (opts.prefill_graph_buckets or DEFAULT_BUCKETS)
                                                   if b <= inputs.prefill_max_bucket))
    if inputs.prefill_graphs and given.step_graphs and not inputs.step_graphs:
        changes.update(prefill_graph_scope="core")
    if given.gemm_warmup and not inputs.gemm_warmup:
        changes.update(gemm_warmup=False)
    elif inputs.gemm_warmup_rows != given.gemm_warmup_rows:
        changes.update(gemm_warmup_rows=inputs.gemm_warmup_rows)
    if given.state_cache and not inputs.state_cache:
        changes.update(state_cache=False)
    if inputs.image_pixels < given.image_pixels:
        changes.update(largest_image_pixels=inputs.image_pixels)
    # a sub-option goes back to its default with its switch turned off (the options refuse it alone)
    defaults = {f.name: f.default for f in dataclasses.fields(VllmOptions)}
    for sub, switch in VllmOptions.NEEDS_SWITCH.items():
        if changes.get(switch) is False:
            changes[sub] = defaults[sub]
    return dataclasses.replace(opts, **changes) if changes else opts


#: The plan's inputs each option decides: an option the operator gave is kept as given by :func:`fit_options`.
PLAN_FIELDS = {"head_graphs": ("head_graph_records",), "head_graph_records": ("head_graph_records",),
               "max_num_batched_tokens": ("max_num_batched_tokens",), "max_num_seqs": ("max_num_seqs",),
               "prefill_graphs": ("prefill_graphs",), "prefill_graph_buckets": ("prefill_max_bucket",),
               "prefill_graph_scope": ("step_graphs",), "gemm_warmup": ("gemm_warmup", "gemm_warmup_rows"),
               "gemm_warmup_rows": ("gemm_warmup_rows",), "state_cache": ("state_cache_bytes",),
               "largest_image_pixels": ("image_pixels",)}


def fit_options(model_dir, opts: VllmOptions, device: tuple[int, tuple[int, int]] | None = None,
                given: frozenset[str] = frozenset()) -> tuple[VllmOptions, MemoryPlan | None]:
    """The options the engine starts with and the plan behind them (``None``: no GPU known, the options as
    given). ``given``: the options the operator set (flags given, keywords passed); the plan keeps them and
    turns only the others down. Raises :class:`~clef_vllm.plan.memory_plan.PlanDoesNotFit`."""
    device = device if device is not None else device_memory()
    if device is None:
        return opts, None
    total, capability = device
    model = model_shape_for_checkpoint(model_dir)
    inputs = PlanInputs.from_options(opts, int(opts.resolved_gpu_memory_utilization * total))
    if inputs.nvfp4_kernel == "auto":
        kernel = "vllm" if opts.linear_backend_chosen else choose_nvfp4_kernel(model, inputs, capability)
        inputs = dataclasses.replace(inputs, nvfp4_kernel=kernel)
    keep = frozenset(name for option in given for name in PLAN_FIELDS.get(option, ()))
    plan = fit(model, inputs, keep=keep)
    for line in plan.changes:
        log.warning("clef memory plan: %s", line)
    if keep and plan.max_concurrency < MIN_SEQUENCES:
        flags = ", ".join(sorted({flag_of(option) for option in given if option in PLAN_FIELDS}))
        log.warning("clef memory plan: kept as given: %s (the KV cache holds %.2f sequences of %s tokens; %g "
                    "wanted)", flags, plan.max_concurrency, f"{plan.inputs.max_model_len:,}", MIN_SEQUENCES)
    head, *rest = plan.describe()
    log.info("clef memory plan: %s", head)
    for line in rest:
        log.info("clef memory plan:   %s", line)
    if opts.nvfp4_kernel == "auto" and model.nvfp4_modules:
        kernel = plan.inputs.nvfp4_kernel
        why = ("BF16 weights, dequantized at load, leave the KV cache room" if kernel == "bf16" else
               "--linear-backend chooses" if opts.linear_backend_chosen else
               "native NVFP4 on this GPU" if resolve_nvfp4_kernel("auto", capability) != "bf16" else
               f"packed weights: dequantized to BF16 they would leave the KV cache of a {gib(inputs.budget_bytes)} "
               f"GiB budget less than {MIN_BF16_SEQUENCES} sequences of {opts.max_model_len:,} tokens")
        log.info("clef memory plan: --nvfp4-kernel auto chose %s (%s)", kernel, why)
    return options_for(opts, plan.inputs), plan


def plan_for_checkpoint(model_dir: str | Path, *, device_total_bytes: int,
                        gpu_memory_utilization: float | None = None, options=None, capability=None,
                        min_sequences: float = MIN_SEQUENCES, **settings) -> MemoryPlan:
    """The fitted plan of the checkpoint at ``model_dir`` on a device of ``device_total_bytes``.

    ``options``: a ``VllmOptions`` (default: the server's defaults); ``gpu_memory_utilization``: the
    budget's share of the device (default: the options'); ``settings``: any :class:`PlanInputs` field on
    top. ``nvfp4_kernel`` ``auto`` is resolved by :func:`choose_nvfp4_kernel` (``capability``: the GPU's,
    when known). Raises :class:`PlanDoesNotFit`."""
    if options is None:
        options = VllmOptions()
    share = options.resolved_gpu_memory_utilization if gpu_memory_utilization is None else gpu_memory_utilization
    model = model_shape_for_checkpoint(model_dir)
    inputs = PlanInputs.from_options(options, int(share * device_total_bytes), **settings)
    if inputs.nvfp4_kernel == "auto":
        inputs = dataclasses.replace(inputs, nvfp4_kernel=choose_nvfp4_kernel(model, inputs, capability))
    return fit(model, inputs, min_sequences=min_sequences)
