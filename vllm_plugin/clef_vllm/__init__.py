"""clef-vllm: serve Cloudflare's Clef-Flash decision model over the SystemOne protocol.

Importing this package is cheap: no torch, no vLLM, no CUDA. ``register()`` is the
``vllm.general_plugins`` entry point; ``Clef`` (the offline API) is imported lazily.
"""

import os as _os


# ``torch.cuda.is_available()`` normally calls cudaGetDeviceCount, which "poisons" fork: vLLM's
# engine-core process, forked later from this process, then dies with "Cannot re-initialize CUDA
# in forked subprocess" while torch.cuda.is_initialized() still says False (so vLLM does not
# switch to spawn). The NVML-based check answers the same question without touching CUDA.
_os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

from clef_vllm.model.layout import ARCHITECTURE  # noqa: E402 - after the environment above
from clef_vllm.plugin import register  # noqa: E402
from clef_vllm.version import __version__  # noqa: E402


def __getattr__(name):
    if name == "Clef":
        from clef_vllm.api import Clef

        return Clef
    raise AttributeError(f"module 'clef_vllm' has no attribute {name!r}")


__all__ = ["ARCHITECTURE", "Clef", "__version__", "register"]
