"""Backends behind one interface: ``reference`` (transformers, CPU/GPU) and ``vllm`` (GPU engine)."""

from __future__ import annotations

import importlib.util
import logging

from clef_vllm.backends.base import Backend, parse_dtype
from clef_vllm.backends.options import OptionError, ReferenceOptions, VllmOptions, backend_options

log = logging.getLogger("clef_vllm")

BACKENDS = ("auto", "reference", "vllm")


def vllm_usable() -> tuple[bool, str]:
    """Whether the vLLM backend can run here (a CUDA GPU and an importable vLLM), and why not."""
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA GPU visible"
    if importlib.util.find_spec("vllm") is None:
        from clef_vllm.backends.vllm_backend import VLLM_MISSING

        return False, f"vLLM is not installed ({VLLM_MISSING})"
    return True, "CUDA GPU and vLLM available"


def resolve_backend(name: str) -> str:
    """``auto`` -> ``vllm`` when a CUDA GPU and vLLM are usable, else ``reference``."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name != "auto":
        return name
    ok, why = vllm_usable()
    log.info("backend auto -> %s (%s)", "vllm" if ok else "reference", why)
    return "vllm" if ok else "reference"


def make_backend(model_dir, backend: str = "auto", **options) -> Backend:
    """Build a backend for ``model_dir``.

    ``options`` are the chosen backend's typed options (:class:`ReferenceOptions` /
    :class:`VllmOptions`; ``None`` = default). They are validated before anything is loaded: an
    unknown option, one of the other backend, or a bad value raises :class:`OptionError`."""
    kind = resolve_backend(backend)
    if kind == "reference":
        from clef_vllm.backends.reference import ReferenceBackend

        return ReferenceBackend(model_dir, backend_options(kind, options))
    from clef_vllm.backends.vllm_backend import VllmBackend

    return VllmBackend(model_dir, **options)     # validates them first; its memory plan keeps the ones given


__all__ = ["BACKENDS", "Backend", "OptionError", "ReferenceOptions", "VllmOptions", "backend_options", "make_backend",
           "parse_dtype", "resolve_backend", "vllm_usable"]
