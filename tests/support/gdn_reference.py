"""A plain-torch Gated DeltaNet core (conv1d, gating prep, recurrent delta rule) for CPU tests.

Same contract as :class:`clef_vllm.worker.fast.prefill_graphs.GdnKernels`; fp32, one token at a time,
so it is exact where the math is: it checks the padding rules of the prefill graphs, not vLLM's
chunked Triton kernels (those are compared on the GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from clef_vllm.worker.fast.prefill_graphs import GdnKernels


def conv(x, layer, has_init, lines, query_start_loc, meta):
    """Causal depthwise conv1d + SiLU over ``x`` [dim, T]; stores the last width-1 inputs."""
    w = layer.conv_weight                                    # [dim, width]
    width = w.shape[1]
    line = int(lines[0])
    state = layer.conv_state[line].float() if bool(has_init[0]) else x.new_zeros(x.shape[0], width - 1).float()
    full = torch.cat([state, x.float()], dim=1)              # [dim, width-1+T]
    out = sum(w[:, k:k + 1].float() * full[:, k:k + x.shape[1]] for k in range(width))
    layer.conv_state[line] = full[:, -(width - 1):].to(layer.conv_state.dtype)
    return F.silu(out).to(x.dtype)


def _l2norm(t):
    t = t.float()
    return t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)


def prep(y, a, b, layer):
    hk, dk, dv = layer.num_k_heads, layer.head_k_dim, layer.head_v_dim
    n = y.shape[0]
    q = _l2norm(y[:, :hk * dk].reshape(n, hk, dk)).to(y.dtype)
    k = _l2norm(y[:, hk * dk:2 * hk * dk].reshape(n, hk, dk)).to(y.dtype)
    v = y[:, 2 * hk * dk:].reshape(n, -1, dv).contiguous()
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
    beta = torch.sigmoid(b.float())
    return q, k, v, g.contiguous(), beta.contiguous()


def rule(q, k, v, g, beta, h0, cu_seqlens, chunk_indices, chunk_offsets, *, layer=None):
    """Recurrent gated delta rule; state [H_v, d_v, d_k] as vLLM stores it."""
    s = h0[0].float().clone()
    rep = v.shape[2] // q.shape[2]
    scale = q.shape[-1] ** -0.5
    outs = []
    for t in range(q.shape[1]):
        kt = k[0, t].float().repeat_interleave(rep, 0)
        qt = q[0, t].float().repeat_interleave(rep, 0)
        s = s * g[0, t].exp()[:, None, None]
        kv = torch.einsum("hvk,hk->hv", s, kt)
        new = beta[0, t][:, None] * (v[0, t].float() - kv)
        s = s + torch.einsum("hv,hk->hvk", new, kt)
        outs.append(torch.einsum("hvk,hk->hv", s, qt) * scale)
    return torch.stack(outs)[None].to(q.dtype), s[None]


def split(qkvz, ba, layer):
    """vLLM's packed op: [q k v | z] and [b | a] into (mixed_qkv, gate [T, heads, dv], b, a)."""
    mixed_qkv, gate = qkvz.split([layer.qkv_size, layer.value_size], dim=-1)
    b, a = ba.chunk(2, dim=-1)
    return mixed_qkv, gate.reshape(gate.shape[0], -1, layer.head_v_dim), b.contiguous(), a.contiguous()


def norm(x, gate, out, layer):
    """Gated RMS norm per head: rmsnorm(x) * weight * silu(gate)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * layer.norm_weight.float() * F.silu(gate.float())
    out.copy_(y.to(out.dtype))


KERNELS = GdnKernels(conv=conv, prep=prep, rule=rule, split=split, norm=norm)
