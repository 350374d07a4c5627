"""Patch embeddings computed as the matrix products they are.

The Qwen-VL and Qwen-Omni vision towers embed each patch (channels x 2 frames x 14 x 14
pixels) with an ``nn.Conv3d`` whose stride is its kernel, over an input already cut
into one patch per row: each output is one dot product of a patch with a filter. On
CPUs PyTorch runs that through a general convolution kernel, about 6x slower than a
matrix product in forward and in the weight's backward (a tiny Qwen2.5-VL, 1,024
patches: 6.1 against 1.0 ms forward). ``install`` gives such convolutions
(``PatchConv3d``) a forward that multiplies the flattened patches by the flattened
filters: the same parameters and the same products, summed in another order (within
about 1e-6 relative in fp32). Any other input goes through the convolution as before.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class PatchConv3d(nn.Conv3d):
    """An ``nn.Conv3d`` with stride equal to its kernel, no padding, dilation or groups,
    whose input of one kernel-sized patch per row runs as ``F.linear``."""

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        if tuple(patches.shape[2:]) != tuple(self.kernel_size):
            return super().forward(patches)
        flat = patches.reshape(patches.shape[0], -1)
        out = F.linear(flat, self.weight.reshape(self.out_channels, -1), self.bias)
        return out.view(patches.shape[0], self.out_channels, 1, 1, 1)


def patch_convolution(module: nn.Module) -> bool:
    """Whether ``module`` is a plain ``nn.Conv3d`` that cuts its input into patches."""
    return (
        type(module) is nn.Conv3d
        and tuple(module.stride) == tuple(module.kernel_size)
        and tuple(module.padding) == (0, 0, 0)
        and tuple(module.dilation) == (1, 1, 1)
        and module.groups == 1
    )


def install(model: nn.Module) -> int:
    """Make every patch convolution of ``model`` a ``PatchConv3d`` (its parameters and
    state dict unchanged); returns how many."""
    found = [m for m in model.modules() if patch_convolution(m)]
    for module in found:
        module.__class__ = PatchConv3d
    return len(found)
