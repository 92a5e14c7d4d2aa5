"""Every GEMM run under a dispatch mode, with its shape: what the head's work issues at the aten level."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class GemmShapes(TorchDispatchMode):
    """Records ``(in_features, out_features, rows)`` of every GEMM (``mm``, ``addmm``, ``linear``) run under it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            a, b = args[0], args[1]
            self.seen.append((b.shape[0], b.shape[1], a.shape[0]))
        elif func is torch.ops.aten.addmm.default:
            a, b = args[1], args[2]
            self.seen.append((b.shape[0], b.shape[1], a.shape[0]))
        elif func is torch.ops.aten.linear.default:      # under inference_mode linear is not decomposed
            x, w = args[0], args[1]
            self.seen.append((w.shape[1], w.shape[0], x.numel() // x.shape[-1]))
        return func(*args, **(kwargs or {}))
