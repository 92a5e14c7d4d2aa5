"""clef-vllm: serve Cloudflare's Clef-Flash decision model over the SystemOne protocol.

Importing this package is cheap: no torch, no vLLM, no CUDA. ``register()`` is the
``vllm.general_plugins`` entry point; ``Clef`` (the offline API) is imported lazily.
"""

import os as _os

__version__ = "0.1.0"

# ``torch.cuda.is_available()`` normally calls cudaGetDeviceCount, which "poisons" fork: vLLM's
# engine-core process, forked later from this process, then dies with "Cannot re-initialize CUDA
# in forked subprocess" while torch.cuda.is_initialized() still says False (so vLLM does not
# switch to spawn). The NVML-based check answers the same question without touching CUDA.
_os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

#: The architecture name written into repacked checkpoints' config.json and used as
#: ``hf_overrides={"architectures": [...]}`` when serving the Cloudflare release.
ARCHITECTURE = "ClefFlashForDecision"

_registered = False


def register() -> None:
    """Register the Clef-Flash architecture with vLLM's ModelRegistry (idempotent, no CUDA)."""
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry

    from clef_vllm.stacks import enable_stack_dumps
    from clef_vllm.worker.dummy_loader import register_loader as register_dummy_loader
    from clef_vllm.worker.scheduler import install_block_hasher

    enable_stack_dumps()   # kill -USR1 <engine core pid> prints where it is (vLLM loads this in every process)
    install_block_hasher()  # a Clef request's state keys are its prefix-cache block hashes
    register_dummy_loader()  # --load-format clef-dummy (benchmarks of quantized layouts without weights)

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "clef_vllm.worker.model:ClefFlashForDecision")
    _registered = True


def __getattr__(name):
    if name == "Clef":
        from clef_vllm.api import Clef

        return Clef
    raise AttributeError(f"module 'clef_vllm' has no attribute {name!r}")


__all__ = ["ARCHITECTURE", "Clef", "__version__", "register"]
