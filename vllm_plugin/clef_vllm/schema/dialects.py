"""One entry for every dialect: :func:`parse_request` parses a decoded JSON body of any :class:`Dialect`.

The SystemOne dialects (``reference``, ``workers-ai``) are validated by
:func:`clef_vllm.schema.protocol.parse_systemone`; OpenAI's Decisions format (``openai``) is mapped to a
SystemOne request by :mod:`clef_vllm.schema.openai_decisions`, which keeps the mapping on the request for
shaping the answer.
"""

from __future__ import annotations

from typing import Any

from clef_vllm.schema.openai_decisions import parse_decision_request
from clef_vllm.schema.protocol import DEFAULT_LIMITS, Dialect, RequestLimits, SystemOneRequest, parse_systemone


def parse_request(body: Any, dialect: Dialect | str = Dialect.REFERENCE,
                  limits: RequestLimits | None = DEFAULT_LIMITS) -> SystemOneRequest:
    """Validate a decoded JSON body into a :class:`SystemOneRequest` or raise
    :class:`~clef_vllm.schema.errors.RequestError`.

    ``limits`` (default: sized for 16,384 tokens; ``None``: none) are checked first, on the raw
    structure, then the request is validated field by field."""
    dialect = Dialect(dialect)
    if dialect is Dialect.OPENAI:
        plan = parse_decision_request(body, limits)
        plan.request._decision = plan
        return plan.request
    return parse_systemone(body, dialect, limits)


__all__ = ["parse_request"]
