"""Random joint heads and records shaped like encoded requests, for the head's tests (the CPU suite
and the GPU head-graph check, tests/gpu/head_graphs.py)."""

from __future__ import annotations

import math
import random

import torch

from clef_vllm.model.features import HeadSpec, RecordAccumulator, accumulate
from clef_vllm.model.head import HeadConfig, JointSchemaHead

VOCAB = 97
SMALL = HeadConfig(hidden_size=48, width=32, routing_layers=2, layers=2, heads=4, feedforward=64)


def random_head(config: HeadConfig, seed: int = 0, prior=0.9, joint=4.8, gate=0.3) -> JointSchemaHead:
    """Every parameter random (biases, LayerNorm affines, scalars), so each one matters."""
    torch.manual_seed(seed)
    head = JointSchemaHead(config)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 / math.sqrt(p.shape[-1]))
            elif name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)
        head.prior_logit_scale.fill_(prior)
        head.joint_logit_scale.fill_(joint)   # above ln 100: exercises the clamp
        head.residual_gate.fill_(gate)
    return head.eval().requires_grad_(False)


# --------------------------------------------------------------------------- random records


def random_record(rng: random.Random, n_fields: int, length: int, hidden: int):
    """Hidden states, token ids and non-overlapping spans like an encoded request's."""
    fields, pos = [], 8
    for _ in range(n_fields):
        a = pos
        b = a + rng.randint(1, 5)
        options, pos = [], b + 2
        for _ in range(rng.randint(1, 6)):
            c = pos + 1
            d = c + rng.randint(1, 4)
            options.append((c, d))
            pos = d + 1
        fields.append((rng.choice([0, 1, 2]), (a, b), options))
        pos += 2
    length = max(length, pos + 3)
    gen = torch.Generator().manual_seed(rng.randint(0, 10**6))
    X = torch.randn(length, hidden, generator=gen) * 2 + 0.5
    ids = [rng.randrange(VOCAB) for _ in range(length)]
    return X, ids, fields


def spec_of(X, ids, fields) -> HeadSpec:
    opt_spans = tuple(tuple(s) for _, _, o in fields for s in o)
    return HeadSpec(num_tokens=X.shape[0], type_ids=tuple(t for t, _, _ in fields),
                    question_spans=tuple(tuple(s) for _, s, _ in fields), option_spans=opt_spans,
                    options_per_field=tuple(len(o) for _, _, o in fields),
                    lexical_ids=tuple(ids[i] for c, d in opt_spans for i in range(c, d)))


def finished(head: JointSchemaHead, records) -> list[RecordAccumulator]:
    """Accumulators of ``records`` (:func:`random_record`) finishing in one step, their hidden states
    in one tensor as vLLM hands a step's rows to the pooler."""
    accs = [RecordAccumulator(spec_of(*r)) for r in records]
    offsets = [sum(r[0].shape[0] for r in records[:i]) for i in range(len(records))]
    accumulate(head, torch.cat([r[0] for r in records]),
               [(a, o, r[0].shape[0], 0) for a, o, r in zip(accs, offsets, records)])
    return accs
