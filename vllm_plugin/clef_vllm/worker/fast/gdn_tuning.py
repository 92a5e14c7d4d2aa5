"""The GDN prefill's Triton kernels tuned for the steps the server runs (``--gdn-tuning``, on by default).

vLLM 0.28 runs the GDN prefill with flash-linear-attention's Triton kernels (the chunked ``kkt`` product,
the triangular solve's merge, ``recompute_w_u``, the state recurrence ``chunk_gated_delta_rule_fwd_h``,
``chunk_fwd_o``, the gate cumsum). Each is autotuned: at its first call Triton times every config and
keeps the fastest for every later call with the same *key*, and their keys leave out the token and
sequence counts. vLLM's Qwen3.5 layers make that first call a warm-up of one 64-token sequence (at its
memory profiling), so a step of 41 sequences and 16,000 tokens runs the configs that were fastest at 64
tokens, where launch time hides the kernels' own. Timed config by config on an H200 at Qwen3.5-9B's GDN
dimensions (``bench/results/h200_gdn_configs.json``): the 64-token choice
costs a 41 x 391-token step 10.8 ms over its 24 GDN layers (1.56 against 1.11 ms a layer), a 16 x
400-token step 4.1 ms, one 16,384-token sequence 5.7 ms, one 416-token decision 0.24 ms. Which config is
fastest depends on the shape: one sequence wants the recurrence split finer (its work is serial along
the sequence), a batch of sequences wants it coarser.

So this module gives each autotuned kernel one tuning per *shape class* (:func:`shape_class`): one
sequence of at most :data:`SHORT_TOKENS` tokens, one longer sequence, several sequences. Each kernel's
autotuner keeps a cache per class and picks the one of the call's class (from the call's sequence count
and token count, host-side integers; nothing is read from the GPU). At the first forward (vLLM's memory
profiling, before any graph capture and while memory is plentiful) the worker runs the GDN chunk op of
its first GDN layer once per class at a representative step (:func:`tuning_shapes`), with the layer's
own parameters and dtypes as vLLM's warm-up does, so every kernel is autotuned there (7 s on a machine
whose Triton cache holds the compiled configs, 59-81 s on a fresh machine, mostly Triton compiling the
configs, which vLLM's own warm-up otherwise does). A kernel
that later meets a key no tuning covered is autotuned at that first call as before, and said
(:data:`STATS`). The classes' choices together are within 0.13 ms a step of the best config for every
shape measured. ``--gdn-tuning off`` leaves vLLM's single tuning.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter

log = logging.getLogger("clef_vllm")

#: A single sequence of at most this many tokens is in the ``one`` class, a longer one in ``one-long``.
SHORT_TOKENS = 1024
#: The classes, in the order they are tuned.
CLASSES = ("one", "one-long", "several")
#: Tuning steps: one short decision (its graph bucket), one long state, and a batch of short decisions
#: as large as the step's token budget allows (at most :data:`SEVERAL_TOKENS`).
ONE_TOKENS = 448
LONG_TOKENS = 4096
SEVERAL_SEQUENCE_TOKENS = 400
SEVERAL_TOKENS = 16384
#: Triton's benchmark per config while tuning (ms): its default (25 ms warm-up, 100 ms of repeats) would
#: make start-up ~4x longer for the same choice at these kernels' 0.01-0.5 ms.
BENCH_WARMUP_MS = 5
BENCH_REP_MS = 20

#: ``tuned``: kernel-class tunings done at start-up; ``late``: autotunings at a real call afterwards
#: (a key the start-up tuning did not cover), by ``kernel/class``.
STATS: Counter = Counter()


def shape_class(sequences: int, tokens: int) -> str:
    """The class of a GDN chunk call of ``sequences`` sequences and ``tokens`` tokens in all."""
    if sequences > 1:
        return "several"
    return "one" if tokens <= SHORT_TOKENS else "one-long"


def tuning_shapes(budget: int, max_len: int) -> list[tuple[str, int, int]]:
    """``(class, sequences, tokens each)`` the start-up tuning runs for a step budget of ``budget`` tokens and
    requests of at most ``max_len``: only shapes the server can meet (no ``one-long`` when no sequence of a
    step can pass :data:`SHORT_TOKENS`, no ``several`` when a step cannot hold two sequences)."""
    longest = min(budget, max_len)
    out = [("one", 1, min(ONE_TOKENS, longest))]
    if min(LONG_TOKENS, longest) > SHORT_TOKENS:
        out.append(("one-long", 1, min(LONG_TOKENS, longest)))
    each = min(SEVERAL_SEQUENCE_TOKENS, max_len, budget // 2)
    if each >= 1:
        out.append(("several", max(2, min(budget, SEVERAL_TOKENS) // each), each))
    return out


def call_shape(arg_names, args: tuple, kwargs: dict) -> tuple[int, int]:
    """``(sequences, tokens)`` of one kernel call: from its ``cu_seqlens`` (its length, a host-side shape) and
    its ``T`` (an int); a call without ``cu_seqlens`` is one sequence."""
    named = dict(zip(arg_names, args))
    named.update(kwargs)
    cu = named.get("cu_seqlens")
    sequences = int(cu.shape[0]) - 1 if cu is not None else 1
    tokens = named.get("T")
    return sequences, int(tokens) if isinstance(tokens, int) else 0


class ClassedTuner:
    """One autotuner's caches by shape class. :meth:`run` stands in for the autotuner's ``run``: it points the
    autotuner's cache at the call's class, runs it, and counts a tuning the call made outside the start-up
    tuning (``tuning_now``)."""

    def __init__(self, tuner, name: str):
        self.tuner, self.name = tuner, name
        self.caches: dict[str, dict] = {"one": tuner.cache}     # vLLM's own 64-token tuning, if it ran
        self.tuning_now = False
        self._run = tuner.run
        # vLLM turns on Triton's disk cache of autotuning results (TRITON_CACHE_AUTOTUNING=1), keyed without the
        # class: it would hand the last class tuned to every class of the next start, and to every other process
        # on the machine (a raw vLLM engine beside the server included). A classed tuner neither reads nor writes it.
        tuner.cache_results = False

    def chosen(self) -> dict[str, str]:
        """Each class's config (the first key's, the one the start-up tuning made), for the log."""
        out = {}
        for cls, cache in self.caches.items():
            if cache:
                config = next(iter(cache.values()))
                out[cls] = ", ".join(f"{k}={v}" for k, v in config.all_kwargs().items() if v is not None) \
                    if hasattr(config, "all_kwargs") else str(config)
        return out

    def run(self, *args, **kwargs):
        sequences, tokens = call_shape(self.tuner.arg_names, args, kwargs)
        cls = shape_class(sequences, tokens)
        cache = self.tuner.cache = self.caches.setdefault(cls, {})
        before = len(cache)
        out = self._run(*args, **kwargs)
        if len(cache) > before:
            STATS["tuned" if self.tuning_now else "late"] += 1
            if not self.tuning_now:
                STATS[f"late {self.name}/{cls}"] += 1
                log.info("clef GDN tuning: %s autotuned at its first call in class %s (%d sequence(s), %d tokens)",
                         self.name, cls, sequences, tokens)
        return out

    def forget(self, cls: str) -> None:
        """Drop one class's tuning (the start-up tuning of that class replaces it)."""
        self.caches[cls] = {}


#: The installed tuners, by kernel name (empty until :func:`install`).
TUNERS: dict[str, ClassedTuner] = {}


def autotuned_kernels() -> dict:
    """flash-linear-attention's autotuned GDN kernels (Triton ``Autotuner`` objects, heuristics unwrapped), by name."""
    from triton.runtime.autotuner import Autotuner
    from vllm.third_party.flash_linear_attention import ops
    from vllm.third_party.flash_linear_attention.ops import chunk  # noqa: F401  (imports every kernel module)

    found = {}
    for module in list(vars(ops).values()):
        for obj in list(getattr(module, "__dict__", {}).values()):
            fn = obj
            for _ in range(4):
                if fn is None or isinstance(fn, Autotuner):
                    break
                fn = getattr(fn, "fn", None)
            if isinstance(fn, Autotuner) and len(fn.configs) > 1:
                found[fn.base_fn.__name__] = fn
    return found


def install(kernels: dict | None = None) -> int:
    """Give every autotuned GDN kernel its per-class caches (idempotent); returns how many it wrapped."""
    kernels = autotuned_kernels() if kernels is None else kernels
    added = 0
    for name, tuner in kernels.items():
        if name in TUNERS and TUNERS[name].tuner is tuner:
            continue
        wrapper = ClassedTuner(tuner, name)
        tuner.run = wrapper.run
        TUNERS[name] = wrapper
        added += 1
    return added


class _fast_bench:
    """While tuning: every wrapped autotuner benchmarks with :data:`BENCH_REP_MS` of repeats; its own
    benchmarker (a cached property) is back afterwards."""

    def __enter__(self):
        import triton.testing

        bench = functools.partial(triton.testing.do_bench, warmup=BENCH_WARMUP_MS, rep=BENCH_REP_MS)
        for wrapper in TUNERS.values():
            wrapper.tuning_now = True
            wrapper.tuner.__dict__["do_bench"] = bench
        return self

    def __exit__(self, *exc):
        for wrapper in TUNERS.values():
            wrapper.tuning_now = False
            wrapper.tuner.__dict__.pop("do_bench", None)
        return False


def run_chunk_op(layer, sequences: int, each: int, dtype, device) -> None:
    """The layer's GDN chunk op once, on ``sequences`` sequences of ``each`` tokens, inputs made as vLLM's
    warm-up makes them (its post-convolution prep with the layer's own gate parameters; no initial state)."""
    import torch
    from vllm.third_party.flash_linear_attention.ops.fused_gdn_prefill_post_conv import fused_post_conv_prep
    from vllm.third_party.flash_linear_attention.ops.index import prepare_chunk_indices, prepare_chunk_offsets
    from vllm.third_party.flash_linear_attention.ops.utils import FLA_CHUNK_SIZE

    tp = layer.tp_size
    k_heads, v_heads = layer.num_k_heads // tp, layer.num_v_heads // tp
    tokens = sequences * each
    mixed = torch.randn(tokens, 2 * k_heads * layer.head_k_dim + v_heads * layer.head_v_dim, device=device, dtype=dtype)
    a = torch.randn(tokens, v_heads, device=device, dtype=dtype)
    b = torch.randn(tokens, v_heads, device=device, dtype=dtype)
    q, k, v, g, beta = fused_post_conv_prep(conv_output=mixed, a=a, b=b, A_log=layer.A_log, dt_bias=layer.dt_bias,
                                            num_k_heads=k_heads, head_k_dim=layer.head_k_dim,
                                            head_v_dim=layer.head_v_dim, apply_l2norm=True, output_g_exp=False)
    _, state_dtype = layer.get_state_dtype()
    state = torch.zeros(sequences, v_heads, layer.head_v_dim, layer.head_k_dim, device=device, dtype=state_dtype)
    cu = torch.arange(0, tokens + 1, each, device=device, dtype=torch.int32)
    layer.chunk_gated_delta_rule(q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0), g=g.unsqueeze(0),
                                 beta=beta.unsqueeze(0), initial_state=state, output_final_state=True, cu_seqlens=cu,
                                 chunk_indices=prepare_chunk_indices(cu, FLA_CHUNK_SIZE),
                                 chunk_offsets=prepare_chunk_offsets(cu, FLA_CHUNK_SIZE),
                                 use_qk_l2norm_in_kernel=False)


def tune(model, budget: int, max_len: int, dtype, device) -> dict:
    """Tune every class of :func:`tuning_shapes` on ``model``'s first GDN layer; returns what ran, by class
    (sequences, tokens each, seconds). The worker calls it only where the layers run the Triton GDN kernels
    (:func:`clef_vllm.worker.fast.prefill_graphs.triton_gdn`)."""
    import torch

    from clef_vllm.worker.fast.prefill_graphs import gdn_layers

    layers = gdn_layers(model)
    if not layers or not TUNERS:
        return {}
    layer = layers[0]
    report = {}
    with torch.inference_mode(), _fast_bench():
        for cls, sequences, each in tuning_shapes(budget, max_len):
            t0 = time.perf_counter()
            for wrapper in TUNERS.values():
                wrapper.forget(cls)
            run_chunk_op(layer, sequences, each, dtype, device)
            torch.cuda.synchronize(device)
            report[cls] = {"sequences": sequences, "tokens_each": each, "seconds": round(time.perf_counter() - t0, 2)}
    for name, wrapper in sorted(TUNERS.items()):
        chosen = wrapper.chosen()
        if chosen:
            log.info("clef GDN tuning: %s: %s", name, "; ".join(f"{cls}: {cfg}" for cls, cfg in chosen.items()))
    return report


def describe() -> str:
    """The tunings so far, for the worker's periodic log line."""
    late = sorted((k[5:], n) for k, n in STATS.items() if k.startswith("late "))
    return (f"{STATS['tuned']} kernel tunings at start-up, {STATS['late']} at a first call later"
            + (f" ({', '.join(f'{k} x{n}' for k, n in late)})" if late else ""))


__all__ = ["CLASSES", "ClassedTuner", "STATS", "TUNERS", "describe", "install", "shape_class", "tune", "tuning_shapes"]
