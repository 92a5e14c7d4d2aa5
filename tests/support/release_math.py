"""The release's math written out literally, as an independent oracle for the tests.

:func:`literal_logits` loops per field and per option and uses PyTorch's own
``nn.MultiheadAttention`` and ``nn.TransformerDecoderLayer(norm_first=True, activation="gelu")``
modules loaded from the head's state dict, so it shares no code with ``clef_vllm.model.head``. It
computes in float32 whatever dtype the head holds.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from clef_vllm.model.head import JointSchemaHead


@torch.no_grad()
def literal_logits(head: JointSchemaHead, X, ids, E, fields) -> list[torch.Tensor]:
    """The head's forward pass for ONE record, written out with loops (docs/encoding-and-head.md, "The joint
    schema head"). ``fields = [(type_id, (a, b), [(c, d), ...])]``: question span and option spans."""
    cfg = head.config
    sd = {k: v.detach().float() for k, v in head.state_dict().items()}
    D, L = cfg.width, X.shape[0]

    def ln(name, x):
        return F.layer_norm(x, (x.shape[-1],), sd[f"{name}.weight"], sd[f"{name}.bias"], eps=1e-5)

    def W(name, x):
        return sd[f"{name}.weight"] @ x

    def mha(prefix):
        m = nn.MultiheadAttention(D, cfg.heads, dropout=0.0, bias=True, batch_first=True)
        m.load_state_dict({k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}, strict=True)
        return m.eval()

    S = ln("hidden_norm", X)                                  # [L, H]
    M = S @ sd["memory_projection.weight"].T                   # [L, D]
    g = S[L - 1]
    q, lex, U = [], [], []
    for _, (a, b), options in fields:
        q_k = S[a:b].mean(0)
        q.append(q_k)
        lex.append([])
        for c, d in options:
            ctx = S[c:d].mean(0)
            lx = torch.stack([E[ids[i]] for i in range(c, d)]).mean(0)
            lex[-1].append(lx)
            U.append(W("option_context_projection", ctx) + W("option_lexical_projection", lx)
                     + W("option_question_projection", q_k))
    U = torch.stack(U)
    for r in range(cfg.routing_layers):
        p = f"evidence_layers.{r}."
        attn = mha(p + "attention.")
        mem = ln(p + "memory_norm", M)
        U = U + attn(ln(p + "query_norm", U)[None], mem[None], mem[None], need_weights=False)[0][0]
        h = ln(p + "feedforward_norm", U)
        h = F.gelu(h @ sd[p + "feedforward.0.weight"].T + sd[p + "feedforward.0.bias"])
        U = U + h @ sd[p + "feedforward.3.weight"].T + sd[p + "feedforward.3.bias"]
    R, start = [], 0
    for _, _, options in fields:
        R.append(U[start:start + len(options)])
        start += len(options)

    Fk = []
    for k, (t, _, options) in enumerate(fields):
        f0 = W("question_projection", q[k])
        scores = torch.stack([R[k][j] @ f0 / math.sqrt(D) for j in range(len(options))])
        att = torch.softmax(scores, 0)
        s_k = sum(att[j] * R[k][j] for j in range(len(options)))
        Fk.append(f0 + ln("option_summary_norm", s_k) + W("global_projection", g) + sd["type_embedding.weight"][t])
    Fm = torch.stack(Fk)[None]
    for layer_index in range(cfg.layers):
        layer = nn.TransformerDecoderLayer(D, cfg.heads, cfg.feedforward, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        prefix = f"layers.{layer_index}."
        layer.load_state_dict({k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}, strict=True)
        Fm = layer.eval()(Fm, M[None])
    Fm = ln("field_norm", Fm[0])

    sp = math.exp(min(float(sd["prior_logit_scale"]), math.log(100)))
    sj = math.exp(min(float(sd["joint_logit_scale"]), math.log(100)))
    gamma = 1 / (1 + math.exp(-float(sd["residual_gate"])))
    out = []
    for k, (_, _, options) in enumerate(fields):
        logits = []
        for j in range(len(options)):
            anchor = q[k] + g
            prior = sp * (lex[k][j] / max(lex[k][j].norm(), 1e-12)) @ (anchor / max(anchor.norm(), 1e-12))
            o = ln("option_norm", R[k][j])
            f = Fm[k]
            x = torch.cat([f, o, f * o, (f - o).abs()])
            res = sd["residual_scorer.3.weight"] @ F.gelu(sd["residual_scorer.0.weight"] @ x
                                                          + sd["residual_scorer.0.bias"]) + sd["residual_scorer.3.bias"]
            cos = (f @ o) / max(float(f.norm() * o.norm()), 1e-8)
            logits.append(prior + gamma * (sj * cos + res[0]))
        out.append(torch.stack(logits))
    return out
