"""The real ``clef-systemone`` app (HTTP, validation, encoding, admission, metrics, answers) over a
backend that answers instantly with uniform probabilities: the front-end's own ceiling, and a
check that a load generator is not the bottleneck (CPU only, no model).

    python bench/instant_server.py CKPT PORT          # CKPT: any checkpoint folder (its tokenizer)
    clef-bench http://127.0.0.1:PORT --tokenizer CKPT --workload short --concurrency 1,16,64
"""

from __future__ import annotations

import sys

import torch
import uvicorn

from clef_vllm.backends.base import Backend
from clef_vllm.encoding import RequestEncoder
from clef_vllm.server.app import create_app
from clef_vllm.server.settings import ServerSettings


class InstantBackend(Backend):
    name = "instant"

    def __init__(self, checkpoint: str):
        self.max_model_len = 16384
        self.encoder = RequestEncoder.from_pretrained(checkpoint, max_length=self.max_model_len)

    def decide_batch(self, encoded):
        return [torch.cat([torch.full((len(f.option_spans),), 1.0 / len(f.option_spans)) for f in e.fields])
                for e in encoded]

    async def decide(self, encoded):
        return self.decide_batch([encoded])[0]

    def describe(self) -> dict:
        return {"backend": "instant"}


def main() -> int:
    checkpoint, port = sys.argv[1], int(sys.argv[2])
    uvicorn.run(create_app(lambda: InstantBackend(checkpoint), ServerSettings()), host="127.0.0.1", port=port,
                log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
