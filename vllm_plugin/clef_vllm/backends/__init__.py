"""Backends behind one interface: ``reference`` (transformers, CPU/GPU) and ``vllm`` (GPU engine)."""

from __future__ import annotations

import importlib.util
import logging

from clef_vllm.backends.base import Backend, parse_dtype

log = logging.getLogger("clef_vllm")

BACKENDS = ("auto", "reference", "vllm")


def vllm_usable() -> tuple[bool, str]:
    """Whether the vLLM backend can run here (a CUDA GPU and an importable vLLM), and why not."""
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA GPU visible"
    if importlib.util.find_spec("vllm") is None:
        return False, "vLLM is not installed (pip install 'clef-vllm[vllm]')"
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
    """Build a backend for ``model_dir``. ``options`` are the backend's keyword arguments."""
    kind = resolve_backend(backend)
    if kind == "reference":
        from clef_vllm.backends.reference import ReferenceBackend

        allowed = {"device", "dtype", "max_model_len", "max_batch_size", "max_batch_tokens"}
        return ReferenceBackend(model_dir, **{k: v for k, v in options.items() if k in allowed and v is not None})
    from clef_vllm.backends.vllm_backend import VllmBackend

    return VllmBackend(model_dir, **{k: v for k, v in options.items() if v is not None and k != "device"})


__all__ = ["BACKENDS", "Backend", "make_backend", "parse_dtype", "resolve_backend", "vllm_usable"]
