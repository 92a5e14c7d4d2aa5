"""ClefPooler: the joint schema head inside vLLM's worker, as a ``Pooler`` (task ``"plugin"``,
:data:`clef_vllm.contract.POOLING_TASK`).

vLLM calls the pooler on every step with that step's hidden states, also for partial
prefills (chunked prefill). Per request, a :class:`~clef_vllm.features.RecordAccumulator`
kept on the request's ``PoolingStates`` absorbs each chunk (memory projection, span sums, last
state); when the prompt is complete the head runs for every request finishing in this step at
once, and the pooler returns that request's fp32 per-option probabilities — a few floats, never
a [L, 4096] tensor. Unfinished requests get ``None`` (vLLM finishes a pooling request on its
first non-None output).

Per-request head specs travel in ``PoolingParams.extra_kwargs["clef"]``
(:data:`clef_vllm.contract.PARAMS_KEY`; plain lists, msgpack safe). vLLM's memory profiling and warm-up call the pooler without them: those requests get a
synthetic spec so the profiler sees representative head work.
"""

from __future__ import annotations

import logging
from collections.abc import Set

import torch
from vllm.model_executor.layers.pooler import Pooler, PoolingParamsUpdate

from clef_vllm.contract import PARAMS_KEY, POOLING_TASK
from clef_vllm.features import HeadSpec, RecordAccumulator, accumulate, decide_records, synthetic_spec
from clef_vllm.head import JointSchemaHead
from clef_vllm.tables import LexicalTable

log = logging.getLogger("clef_vllm")


class ClefPooler(Pooler):
    """Implements vLLM's ``Pooler`` contract; the math lives in :mod:`clef_vllm.features`."""

    def __init__(self, head: JointSchemaHead, table: LexicalTable):
        super().__init__()
        # Plain references: the head and the table are registered on the model itself.
        object.__setattr__(self, "_head", head)
        object.__setattr__(self, "_table", table)

    def get_supported_tasks(self) -> Set[str]:
        return {POOLING_TASK}

    def get_pooling_updates(self, task) -> PoolingParamsUpdate:
        return PoolingParamsUpdate()

    def _accumulator(self, params, states, prompt_len: int, start: int) -> RecordAccumulator | None:
        acc = getattr(states, "clef", None)
        if acc is not None and start == 0 and acc.filled > 0:
            acc = None  # the request was preempted and restarts its prefill
        if acc is None:
            wire = (params.extra_kwargs or {}).get(PARAMS_KEY) if params is not None else None
            if wire is None:
                spec = synthetic_spec(prompt_len)
            else:
                try:
                    spec = HeadSpec.from_wire(wire)
                    spec.validate()
                    if spec.num_tokens != prompt_len:
                        raise ValueError(f"spec is for {spec.num_tokens} tokens, prompt has {prompt_len}")
                except (KeyError, TypeError, ValueError) as exc:
                    log.error("clef pooler: bad head spec (%s); request answered with NaN", exc)
                    spec = None
            if spec is None:
                states.clef = False
                return None
            acc = RecordAccumulator(spec)
            states.clef = acc
        elif acc is False:
            return None
        if acc.filled != start:
            log.error("clef pooler: chunk starts at %d but %d positions were seen", start, acc.filled)
        return acc

    def forward(self, hidden_states: torch.Tensor, pooling_metadata) -> list[torch.Tensor | None]:
        cursor = pooling_metadata.get_pooling_cursor()
        scheduled = cursor.num_scheduled_tokens_cpu.tolist()
        seq_lens = cursor.seq_lens_cpu.tolist()
        prompt_lens = cursor.prompt_lens_cpu.tolist()
        params = pooling_metadata.pooling_params
        states = pooling_metadata.pooling_states
        out: list[torch.Tensor | None] = [None] * len(scheduled)
        pieces, finishing, offset = [], [], 0
        device = hidden_states.device
        for i, n in enumerate(scheduled):
            start = seq_lens[i] - n
            acc = self._accumulator(params[i], states[i], prompt_lens[i], start)
            done = seq_lens[i] >= prompt_lens[i]
            if acc is not None and n > 0:
                pieces.append((acc, offset, n, start))
                if done:
                    finishing.append((i, acc))
            elif acc is None and done:
                out[i] = torch.full((1,), float("nan"), device=device)
            offset += n
        accumulate(self._head, hidden_states, pieces)
        if finishing:
            probs = decide_records(self._head, self._table, [acc for _, acc in finishing])
            for (i, _), p in zip(finishing, probs):
                out[i] = p
                states[i].clef = None
        return out
