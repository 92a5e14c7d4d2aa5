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
from clef_vllm.schema.media import MEDIA_KEYS, decode_media
from clef_vllm.schema.openai_decisions import check_fits
from clef_vllm.schema.protocol import SYSTEMONE_DIALECTS, Dialect, RequestLimits, attach_media


class Clef:
    """Decide SystemOne requests with a Clef checkpoint, without a server.

    ``model_dir``: a checkpoint folder, or ``"demo"`` (the generated tiny demo checkpoint).
    ``backend``: ``"auto"`` (vLLM when a CUDA GPU and vLLM are usable, else reference),
    ``"reference"`` or ``"vllm"``. ``dtype``: the model's dtype (on the reference backend a
    ``"float32"`` model is float32 throughout, backbone and head, as the release's own loader;
    the vLLM backend runs ``"bfloat16"``; ``head_dtype="float32"`` gives a float32 head on either).
    ``engine_options`` are the backend's typed options (:mod:`clef_vllm.backends.options`, e.g.
    ``device="cuda"`` for reference; ``gpu_memory_utilization=0.5`` for vLLM); one that does not
    exist or belongs to the other backend raises :class:`~clef_vllm.backends.OptionError`.
    """

    def __init__(self, model_dir: str | Path | None = "demo", backend: str = "auto", dtype: str = "bfloat16",
                 max_model_len: int = DEFAULT_MAX_LENGTH, dialect: str = "reference", **engine_options: Any):
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
        the server validates them (docs/protocol.md, Media), then refused: this build's model sees no images."""
        return self.systemone_batch([request])[0]

    def systemone_batch(self, requests: Sequence[dict]) -> list[dict]:
        """Answer many requests in one batch (order preserved). An invalid request raises
        :class:`~clef_vllm.schema.errors.RequestError` naming its index (``requests[3].questions.x...``)
        before any work is done."""
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
        parsed, encoded = [], []
        limits = self.backend.encoder.request_limits()
        for i, body in enumerate(requests):
            try:
                req = _parse(body, dialect, limits)
                enc = self.backend.encoder.encode(req)
                if dialect is Dialect.OPENAI:
                    check_fits(enc)
            except ClefError as exc:
                raise exc.with_field_prefix(f"requests[{i}]" if len(requests) > 1 else None) from None
            parsed.append(req)
            encoded.append(enc)
        if not encoded:
            return []
        probs = self.backend.decide_batch(encoded)
        return [build_response(r, e, p, dialect) for r, e, p in zip(parsed, encoded, probs)]

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> "Clef":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _parse(body: Any, dialect: Dialect, limits: RequestLimits) -> Any:
    """``parse_request``, with the offline forms of media (``PIL.Image``, bytes, paths) and their pixels decoded."""
    if dialect is Dialect.OPENAI or not isinstance(body, dict) or not MEDIA_KEYS.keys() & body.keys():
        return parse_request(body, dialect, limits)
    req = parse_request({k: v for k, v in body.items() if k not in MEDIA_KEYS}, dialect, limits)
    attach_media(req, body.get("images"), body.get("videos"), dialect, limits, local=True)
    decode_media(req._media)
    return req
