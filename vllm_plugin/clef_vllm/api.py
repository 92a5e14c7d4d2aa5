"""Offline Python API.

>>> from clef_vllm import Clef
>>> with Clef("path/to/checkpoint", backend="reference") as clef:
...     clef.systemone({"model": "clef-flash", "state": "Checkout is down.",
...                     "questions": {"urgent": {"type": "noul", "instructions": "Is this urgent?"}}})
...     clef.decisions({"model": "clef-flash", "input": "Checkout is down.",
...                     "questions": [{"type": "predicate", "name": "urgent", "instructions": "Is this urgent?"}]})
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from clef_vllm.backends import Backend, make_backend
from clef_vllm.model.demo import resolve_model_dir
from clef_vllm.schema.answers import build_response
from clef_vllm.schema.dialects import parse_request
from clef_vllm.schema.encoding import DEFAULT_MAX_LENGTH
from clef_vllm.schema.errors import ClefError, RequestError  # noqa: F401 - RequestError is what callers catch
from clef_vllm.schema.media import DEFAULT_MAX_MEDIA_MEMORY, MEDIA_KEYS, decode_media, host_bytes
from clef_vllm.schema.openai_decisions import check_fits
from clef_vllm.schema.protocol import SYSTEMONE_DIALECTS, Dialect, RequestLimits, attach_media


class Clef:
    """Decide SystemOne requests with a Clef checkpoint, without a server.

    ``model_dir``: a checkpoint folder, or ``"demo"`` (the generated tiny demo checkpoint).
    ``backend``: ``"auto"`` (vLLM when a CUDA GPU and vLLM are usable, else reference),
    ``"reference"`` or ``"vllm"``. ``dtype``: the model's dtype (on the reference backend a
    ``"float32"`` model is float32 throughout, backbone and head, as the release's own loader;
    the vLLM backend runs ``"bfloat16"``; ``head_dtype="float32"`` gives a float32 head on either).
    ``max_media_memory``: the host memory (bytes) a batch's images and videos may take at once, each pixel counted
    as the server counts it (:data:`~clef_vllm.schema.media.HOST_BYTES_PER_PIXEL`); a batch with more is encoded
    and decided in consecutive chunks within it (``None``: all at once).
    ``engine_options`` are the backend's typed options (:mod:`clef_vllm.backends.options`, e.g.
    ``device="cuda"`` for reference; ``gpu_memory_utilization=0.5`` for vLLM); one that does not
    exist or belongs to the other backend raises :class:`~clef_vllm.backends.OptionError`.
    """

    def __init__(self, model_dir: str | Path | None = "demo", backend: str = "auto", dtype: str = "bfloat16",
                 max_model_len: int = DEFAULT_MAX_LENGTH, dialect: str = "reference",
                 max_media_memory: int | None = DEFAULT_MAX_MEDIA_MEMORY, **engine_options: Any):
        self.max_media_memory = max_media_memory
        self.dialect = Dialect(dialect)
        if self.dialect not in SYSTEMONE_DIALECTS:
            raise ValueError(f"dialect must be one of {[d.value for d in SYSTEMONE_DIALECTS]}, got {dialect!r} "
                             "(OpenAI's Decisions format: Clef.decisions)")
        self.model_dir = resolve_model_dir(model_dir)
        self.backend: Backend = make_backend(self.model_dir, backend, dtype=dtype, max_model_len=max_model_len,
                                             **engine_options)

    def systemone(self, request: dict) -> dict:
        """Answer one SystemOne request; raises :class:`~clef_vllm.schema.errors.RequestError` (a ValueError
        naming the field; ``.kind`` says what is wrong) for invalid input. ``images`` (and ``videos``, reference
        dialect) may hold ``PIL.Image`` objects, bytes or local paths besides data: URIs; they are validated as
        the server validates them (docs/protocol.md, Media)."""
        return self.systemone_batch([request])[0]

    def systemone_batch(self, requests: Sequence[dict]) -> list[dict]:
        """Answer many requests in one batch (order preserved). An invalid request raises
        :class:`~clef_vllm.schema.errors.RequestError` naming its index (``requests[3].questions.x...``), and no
        answer is returned: a request the parser refuses, before any work is done; one refused at encoding (too
        long; media the processor refuses), once the chunks before it (``max_media_memory``) were decided."""
        return self._batch(requests, self.dialect)

    def decisions(self, request: dict) -> dict:
        """Answer one request in OpenAI's Decisions format (the body ``client.decisions.create`` sends:
        ``model``, ``input``, ``questions``), as ``POST /v1/decisions`` does (clef_vllm.schema.openai_decisions);
        an input that does not fit ``max_model_len`` raises (``context_length_exceeded``), it is not cut."""
        return self.decisions_batch([request])[0]

    def decisions_batch(self, requests: Sequence[dict]) -> list[dict]:
        """Many Decisions requests in one batch (order preserved), as :meth:`systemone_batch`."""
        return self._batch(requests, Dialect.OPENAI)

    def _batch(self, requests: Sequence[dict], dialect: Dialect) -> list[dict]:
        limits = self.backend.encoder.request_limits()
        named = (lambda i: f"requests[{i}]") if len(requests) > 1 else (lambda i: None)
        parsed = []
        for i, body in enumerate(requests):
            try:
                parsed.append(_parse(body, dialect, limits))
            except ClefError as exc:
                raise exc.with_field_prefix(named(i)) from None
        answers: list[dict] = []
        for chunk in media_chunks([host_bytes(req._media) for req in parsed], self.max_media_memory):
            encoded = []
            for i in chunk:
                try:
                    encoded.append(self.backend.encoder.encode(parsed[i]))
                    if dialect is Dialect.OPENAI:
                        check_fits(encoded[-1])
                except ClefError as exc:
                    raise exc.with_field_prefix(named(i)) from None
            probs = self.backend.decide_batch(encoded)
            answers += [build_response(parsed[i], e, p, dialect) for i, e, p in zip(chunk, encoded, probs)]
        return answers

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> "Clef":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def media_chunks(costs: Sequence[int], budget: int | None) -> list[range]:
    """Consecutive runs of requests whose media ``costs`` (bytes) add up to at most ``budget`` (a request costing
    more runs alone; ``None``: one run)."""
    chunks, start, held = [], 0, 0
    for i, cost in enumerate(costs):
        if budget is not None and i > start and held + cost > budget:
            chunks.append(range(start, i))
            start, held = i, 0
        held += cost
    if start < len(costs):
        chunks.append(range(start, len(costs)))
    return chunks


def _parse(body: Any, dialect: Dialect, limits: RequestLimits) -> Any:
    """``parse_request``, with the offline forms of media (``PIL.Image``, bytes, paths) and their pixels decoded."""
    if dialect is Dialect.OPENAI or not isinstance(body, dict) or not MEDIA_KEYS.keys() & body.keys():
        return parse_request(body, dialect, limits)
    req = parse_request({k: v for k, v in body.items() if k not in MEDIA_KEYS}, dialect, limits)
    attach_media(req, body.get("images"), body.get("videos"), dialect, limits, local=True)
    decode_media(req._media)
    return req
