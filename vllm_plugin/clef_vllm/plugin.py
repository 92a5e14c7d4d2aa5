"""The ``vllm.general_plugins`` entry point: what vLLM must know about Clef-Flash in every process.

vLLM calls :func:`register` in the front-end and in each engine-core and worker process before it
builds a model. Importing this module is cheap: the worker side is imported inside :func:`register`.
"""

from __future__ import annotations

from clef_vllm.model.layout import ARCHITECTURE

_registered = False


def register() -> None:
    """Register the Clef-Flash architecture with vLLM's ModelRegistry (idempotent, no CUDA)."""
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry

    from clef_vllm.util.logs import inherit_logging
    from clef_vllm.util.stacks import enable_stack_dumps
    from clef_vllm.worker.dummy_loader import register_loader as register_dummy_loader
    from clef_vllm.worker.scheduler import install_block_hasher

    inherit_logging()      # a spawned engine core logs the plugin's lines as the server does
    enable_stack_dumps()   # kill -USR1 <engine core pid> prints where it is (vLLM loads this in every process)
    install_block_hasher()  # a Clef request's state keys are its prefix-cache block hashes
    register_dummy_loader()  # --load-format clef-dummy (benchmarks of quantized layouts without weights)

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "clef_vllm.worker.model:ClefFlashForDecision")
    _registered = True


__all__ = ["register"]
