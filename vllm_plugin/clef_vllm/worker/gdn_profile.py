"""The GDN prefill's memory inside vLLM's profiling run, so that the KV cache is sized with it.

vLLM 0.28 sizes the KV cache from the peak of one profiling step at ``--max-num-batched-tokens``, but
in that step its GDN layers skip their core (no attention metadata: ``_forward_core`` only warms the
prefill kernels on 64 tokens). What a real prefill step of that many tokens allocates inside the core
is therefore in nobody's count: the causal convolution's output, ``q``/``k``/``v``/``g``/``beta``, the
chunk kernel's intermediates (its per-chunk states grow with the number of chunks, one more per
sequence) and the sequences' initial and final recurrent states. On the 9B at 8,192 tokens that is
several hundred MiB, and a server sized without it runs out of memory at its first long prefill.

:class:`GdnPeakProbe` wraps the warm-up hook of one GDN layer: while the worker has armed it (vLLM's
profiling run, :class:`clef_vllm.worker.budget.ClefWorker`), the profiling step's call runs that core
once at the step's full size, on the live tensors of the profiling forward, as the worst step does:
the step's tokens split into as many sequences of one token over a chunk as ``--max-num-seqs`` allows
(the most chunks and states a step can have: :func:`clef_vllm.plan.graph_costs.worst_prefill_lengths`;
:func:`~clef_vllm.plan.graph_costs.gdn_prefill_bytes` is the plan's estimate of it). Everything it allocates is freed before the layer
returns, so its only trace is the peak vLLM measures, and the KV cache is sized below it. One layer is
enough: every GDN layer has the same shapes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from types import SimpleNamespace

import torch

from clef_vllm.plan.graph_costs import worst_prefill_lengths

log = logging.getLogger("clef_vllm")



def vllm_prep(conv_out, a, b, layer):
    """vLLM 0.28's post-convolution step, called as its prefill path calls it (the prefill graphs' own call,
    :func:`clef_vllm.worker.fast.prefill_graphs.vllm_kernels`), with this rank's share of the key heads."""
    from clef_vllm.worker.fast.prefill_graphs import vllm_kernels

    dims = SimpleNamespace(A_log=layer.A_log, dt_bias=layer.dt_bias, num_k_heads=layer.num_k_heads // layer.tp_size,
                           head_k_dim=layer.head_k_dim, head_v_dim=layer.head_v_dim)
    return vllm_kernels().prep(conv_out, a, b, dims)


class GdnPeakProbe:
    """Runs one GDN layer's prefill core at the profiling step's size while armed (see the module)."""

    def __init__(self, tokens: int, max_sequences: int, *, prep: Callable | None = None):
        self.tokens = int(tokens)
        self.max_sequences = int(max_sequences)
        #: the post-convolution step (:func:`vllm_prep` unless given)
        self.prep = prep
        self.armed = False
        #: What the last probe added to the allocator's peak, in bytes (``None`` before it ran).
        self.raised_peak: int | None = None
        self.runs = 0

    def install(self, model: torch.nn.Module, layers: list | None = None) -> bool:
        """Wrap the first GDN layer of ``model`` (or of ``layers``); ``False`` when it has none."""
        if layers is None:
            from clef_vllm.worker.fast.prefill_graphs import gdn_layers

            layers = gdn_layers(model)
        if not layers:
            return False
        layer = layers[0]
        if getattr(layer, "_clef_peak_probe", None) is self:
            return True
        original = layer._warmup_prefill_kernels

        def warmup(qkv, v_dim, *args, **kwargs):
            out = original(qkv, v_dim, *args, **kwargs)
            if self.armed and qkv.size(0) >= self.tokens and not (qkv.is_cuda and torch.cuda.is_current_stream_capturing()):
                self.armed = False                                   # once per profiling run
                self.run(layer, qkv)
            return out

        layer._warmup_prefill_kernels = warmup
        layer._clef_peak_probe = self
        return True

    @contextlib.contextmanager
    def armed_for_profiling(self):
        """Arm the probe for the block (the worker's call of vLLM's memory profiling)."""
        self.armed = True
        try:
            yield self
        finally:
            self.armed = False

    def run(self, layer, qkv: torch.Tensor) -> None:
        """The prefill core of ``layer`` on a step of ``len(qkv)`` tokens split as :func:`worst_prefill_lengths` splits it; frees all."""
        device, dtype = qkv.device, qkv.dtype
        lengths = worst_prefill_lengths(qkv.size(0), self.max_sequences)
        heads = layer.num_v_heads // layer.tp_size
        ssm_dtype = layer.get_state_dtype()[1]
        cuda = device.type == "cuda"
        before = torch.cuda.max_memory_allocated(device) if cuda else 0
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        cu_seqlens = torch.tensor(offsets, device=device, dtype=torch.int32)
        conv_out = torch.zeros_like(qkv)                         # causal_conv1d_fn's output
        a = torch.zeros(qkv.size(0), heads, device=device, dtype=dtype)
        b = torch.zeros_like(a)
        q, k, v, g, beta = (self.prep or vllm_prep)(conv_out, a, b, layer)
        initial = torch.zeros(len(lengths), heads, layer.head_v_dim, layer.head_k_dim, device=device, dtype=ssm_dtype)
        out, final = layer.chunk_gated_delta_rule(
            q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0), g=g.unsqueeze(0), beta=beta.unsqueeze(0),
            initial_state=initial, output_final_state=True, cu_seqlens=cu_seqlens, chunk_indices=None,
            chunk_offsets=None, use_qk_l2norm_in_kernel=False)
        stored = final.to(ssm_dtype)                             # as the step writes the states back
        del cu_seqlens, conv_out, a, b, q, k, v, g, beta, initial, out, final, stored
        self.runs += 1
        if cuda:
            self.raised_peak = max(0, torch.cuda.max_memory_allocated(device) - before)
            log.info("clef memory budget: vLLM's profiling step ran one GDN layer's prefill core on its %d tokens "
                     "(%d sequences, the most chunks and states a step can hold): %.2f GiB more at its peak",
                     qkv.size(0), len(lengths), self.raised_peak / (1 << 30))
