"""Per-option probabilities -> SystemOne answers and response body (docs/encoding-and-head.md).

Rounding is Python's ``round(x, 4)`` on the float value, applied after argmax and expectation,
which use full-precision values. Key order follows the reference: answers in request order,
choice probabilities in the request's criteria order, score probabilities by level index.
"""

from __future__ import annotations

from typing import Any, Sequence

from clef_vllm.schema.encoding import EncodedRequest
from clef_vllm.schema.protocol import ChoiceQuestion, gini_purity, Dialect, NoulQuestion, SystemOneRequest


def _confidence(raw: Sequence[float], rounded: Sequence[float], dialect: Dialect) -> float:
    if dialect is Dialect.WORKERS_AI:
        return round(gini_purity(rounded), 4)
    return round(max(raw), 4)


def build_answer(question, option_ids: Sequence[str], probs: Sequence[float], dialect: Dialect) -> dict[str, Any]:
    """One answer from the encoded-order option ids and their probabilities (Python floats)."""
    by_id = dict(zip(option_ids, probs))
    if isinstance(question, NoulQuestion):
        return {"type": "noul", "noul": round(by_id["true"], 4)}
    if isinstance(question, ChoiceQuestion):
        order = [str(k) for k in question.criteria]            # request order
        raw = [by_id[k] for k in order]
        best = 0
        for i, p in enumerate(raw):                              # ties -> first in request order
            if p > raw[best]:
                best = i
        rounded = [round(p, 4) for p in raw]
        return {"type": "choice", "choice": order[best], "confidence": _confidence(raw, rounded, dialect),
                "probabilities": dict(zip(order, rounded))}
    raw = list(probs)                                            # score: encoded order == level order
    rounded = [round(p, 4) for p in raw]
    return {"type": "score", "score": round(sum(i * p for i, p in enumerate(raw)), 4),
            "confidence": _confidence(raw, rounded, dialect),
            "legend": {str(i): level for i, level in enumerate(question.criteria)},
            "probabilities": {str(i): p for i, p in enumerate(rounded)}}


def build_response(request: SystemOneRequest, encoded: EncodedRequest, probs,
                   dialect: Dialect | str = Dialect.REFERENCE) -> dict[str, Any]:
    """The SystemOne response body (bare; the HTTP layer adds the hosted envelope for workers-ai); for
    the ``openai`` dialect, the Decisions response built from the reference one (clef_vllm.schema.openai_decisions)."""
    dialect = Dialect(dialect)
    if dialect is Dialect.OPENAI:
        from clef_vllm.schema.openai_decisions import decision_response

        return decision_response(request._decision, build_response(request, encoded, probs, Dialect.REFERENCE))
    values = probs.tolist() if hasattr(probs, "tolist") else list(probs)
    answers, start = {}, 0
    for f in encoded.fields:
        n = len(f.option_ids)
        answers[f.question_id] = build_answer(request.questions[f.question_id], f.option_ids,
                                              values[start:start + n], dialect)
        start += n
    body = {"model": request.model, "answers": answers,
            "usage": {"input_tokens": encoded.num_tokens, "output_tokens": 0,
                      "truncated_state_tokens": encoded.truncated_state_tokens,
                      "cached_state_tokens": encoded.cached_state_tokens}}
    if request._warnings:                       # fields the reference dialect ignored
        body["warnings"] = list(request._warnings)
    return body


def hosted_envelope(body: dict) -> dict:
    """Workers AI's success envelope."""
    return {"result": body, "success": True, "errors": [], "messages": []}
