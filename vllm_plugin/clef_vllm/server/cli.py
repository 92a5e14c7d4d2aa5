"""``clef-systemone``: serve a Clef checkpoint over SystemOne (``POST /v1/systemone``).

Without ``--model`` it serves the generated demo checkpoint (built on first use) on the backend
``auto`` picks: vLLM when a CUDA GPU and vLLM are usable, else the CPU/GPU reference backend.
Engine flags follow vLLM's names.

Testing hook: when ``CLEF_VLLM_LOAD_GATE`` names a file, model loading waits (at most 10 minutes)
until that file exists, so the "loading" state (``/health`` 503) can be observed deterministically.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from clef_vllm import __version__
from clef_vllm.backends import BACKENDS
from clef_vllm.encoding import DEFAULT_MAX_LENGTH
from clef_vllm.protocol import Dialect
from clef_vllm.server.app import DEFAULT_MAX_BODY_BYTES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clef-systemone", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"clef-vllm {__version__}")
    p.add_argument("--model", default="demo",
                   help="checkpoint folder (release or repacked layout); 'demo' = generated tiny demo (default)")
    p.add_argument("--served-model-name", default="clef-flash", help="name reported by /v1/models")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--backend", choices=BACKENDS, default="auto")
    p.add_argument("--dialect", choices=[d.value for d in Dialect], default=Dialect.REFERENCE.value,
                   help="acceptance rules, confidence formula and envelope (default: reference)")
    p.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_LENGTH,
                   help="token limit per request; longer states are cut from the end (default 16384)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the joint head's dtype")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    ref = p.add_argument_group("reference backend")
    ref.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ref.add_argument("--max-batch-size", type=int, default=None, help="requests per micro-batch (default 16)")

    eng = p.add_argument_group("vLLM backend (names as in vLLM)")
    eng.add_argument("--data-parallel-size", "--dp", dest="data_parallel_size", type=int, default=None,
                     help="engines, one per GPU, behind this one port (internal load balancing)")
    eng.add_argument("--gpu-memory-utilization", type=float, default=None)
    eng.add_argument("--max-num-seqs", type=int, default=None)
    eng.add_argument("--max-num-batched-tokens", type=int, default=None)
    eng.add_argument("--enforce-eager", action="store_true", default=None)
    eng.add_argument("--gdn-prefill-backend", "--gdn-backend", dest="gdn_prefill_backend", default=None,
                     choices=["triton", "flashinfer", "cutedsl"],
                     help="GDN prefill kernel (default: triton on Hopper)")
    eng.add_argument("--linear-backend", default=None, help="vLLM --linear-backend (e.g. emulation)")
    eng.add_argument("--quantization", default=None,
                     help="online quantization of a BF16 checkpoint (e.g. fp8); quantized checkpoints need none")
    eng.add_argument("--load-format", default=None,
                     help="vLLM load format; 'dummy' = random weights for benchmarks (configs only)")
    eng.add_argument("--no-warmup", dest="warmup", action="store_false", default=True,
                     help="skip the start-up warm-up (first requests will be slow)")
    return p


def curl_example(host: str, port: int) -> str:
    body = {"model": "clef-flash", "state": "Checkout has been failing for every customer for the last hour.",
            "questions": {"urgent": {"type": "noul", "instructions": "Is this support request urgent?"},
                          "team": {"type": "choice", "instructions": "Which team should handle it?",
                                   "criteria": {"billing": "Payments and refunds", "technical": "Outages and errors"}},
                          "severity": {"type": "score", "criteria": ["No impact", "Minor", "Major", "Critical"]}}}
    shown = "localhost" if host in ("0.0.0.0", "::") else host
    return (f"curl -s http://{shown}:{port}/v1/systemone -H 'Content-Type: application/json' "
            f"-d '{json.dumps(body)}'")


LOAD_GATE_ENV = "CLEF_VLLM_LOAD_GATE"


def _wait_for_load_gate(log: logging.Logger, timeout_s: float = 600.0) -> None:
    """Testing hook: hold model loading until the file named by ``$CLEF_VLLM_LOAD_GATE`` exists."""
    gate = os.environ.get(LOAD_GATE_ENV)
    if not gate:
        return
    log.info("%s is set: loading waits for %s", LOAD_GATE_ENV, gate)
    deadline = time.monotonic() + timeout_s
    while not Path(gate).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("clef_vllm")

    import uvicorn

    from clef_vllm.api import resolve_model_dir
    from clef_vllm.backends import make_backend
    from clef_vllm.server.app import ServerSettings, create_app

    options = {k: getattr(args, k) for k in (
        "device", "max_batch_size", "data_parallel_size", "gpu_memory_utilization", "max_num_seqs",
        "max_num_batched_tokens", "enforce_eager", "gdn_prefill_backend", "linear_backend", "quantization",
        "load_format")}
    options.update(dtype=args.dtype, max_model_len=args.max_model_len, warmup=args.warmup)
    failure: list[BaseException] = []

    def load():
        _wait_for_load_gate(log)
        model_dir = resolve_model_dir(args.model)
        log.info("loading %s (backend %s)", model_dir, args.backend)
        return make_backend(model_dir, args.backend, **options)

    def on_ready():
        print(f"\nclef-systemone {__version__} is serving on http://{args.host}:{args.port}  (docs: /docs)\n"
              f"try:\n  {curl_example(args.host, args.port)}\n", flush=True)

    def on_load_error(exc: BaseException):
        failure.append(exc)
        server.should_exit = True

    settings = ServerSettings(dialect=Dialect(args.dialect), max_body_bytes=args.max_body_bytes,
                              served_model=args.served_model_name, on_ready=on_ready, on_load_error=on_load_error)
    app = create_app(load, settings)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    server = uvicorn.Server(config)
    server.run()
    if failure:
        print(f"clef-systemone: could not load the model: {failure[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
