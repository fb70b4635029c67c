"""Random MXFP4 expert weights for the kernel tests (every code, scales near 2^-6..2^-4)."""
from __future__ import annotations

import torch


def random_experts(E: int, I: int, L: int, gen: torch.Generator, device="cpu"):
    """(w13 [E, 2I, L/2], w13_scale [E, 2I, L/32], w2 [E, L, I/2], w2_scale [E, L, I/32]), uint8."""
    def u8(lo, hi, *shape):
        return torch.randint(lo, hi, shape, generator=gen, dtype=torch.uint8, device=device)
    return u8(0, 256, E, 2 * I, L // 2), u8(118, 124, E, 2 * I, L // 32), u8(0, 256, E, L, I // 2), \
        u8(118, 124, E, L, I // 32)
