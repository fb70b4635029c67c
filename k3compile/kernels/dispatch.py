"""Where GPU kernels plug into the `k3::` ops.

`pick` returns the first kernel of the table (`registry`) whose predicate accepts the call, else
None, and the op runs its PyTorch reference. The device's kernel families (`FAMILIES`, each
registering its kernels beside its launchers) are imported lazily the first time an op runs on
that device type, so CPU use never imports Triton; with K3_KERNELS=0 at that time (or without
Triton) no kernel of the device is picked.
"""
from __future__ import annotations

import importlib

from ..config import env, knob
from . import registry, tuning
from .registry import Kernel

FAMILIES = ("comm", "gemm", "moe", "attention")
_READY: dict[str, bool] = {}


def _load(device: str) -> bool:
    """Whether the kernels of `device` serve calls (their families imported on the first call)."""
    if device not in _READY:
        ok = device == "cuda" and env("K3_KERNELS") != "0"
        if ok:
            try:
                for family in FAMILIES:
                    importlib.import_module(f"k3compile.kernels.{family}")
            except ImportError:  # no Triton: every op runs its reference
                ok = False
        _READY[device] = ok
    return _READY[device]


def pick(op: str, device: str, *args, **kwargs) -> Kernel | None:
    if not _load(device):
        return None
    for k in registry.kernels(op, device):
        if k.accepts(*args, **kwargs):
            return k
    return None


def describe(device: str, group: str | None, moe: tuple | None = None) -> str | None:
    """One line for the match report: which communication path the CUDA kernels will take for
    `group` (None off CUDA, or when K3_KERNELS=0 leaves every op on its reference), and, given the
    routed experts' (I, L, K, M, bf16), which MXFP4 expert kernel runs (moe.experts_note)."""
    if device != "cuda":
        return None
    if env("K3_KERNELS") == "0":
        return "kernels: off (K3_KERNELS=0); every k3 op runs its PyTorch reference"
    if not group:
        line = "kernels: CUDA kernels, TP=1 (no communication)"
    else:
        from ..runtime import symm
        why = symm.unavailable_reason(group)
        line = ("kernels: one-shot communication over symmetric memory (NCCL path outside the measured M ranges; "
                f"{_cols_note()})" if why is None else f"kernels: NCCL path for every communication op ({why})")
        if why is None:
            from .comm import oproj_note
            line += "; " + oproj_note()
    if moe is not None:
        from .moe import experts_note
        line += "; " + experts_note(*moe)
    return line


def _cols_note() -> str:
    """Where the all-reduce / norm and latent-tail kernels take their column-split forms."""
    flag = knob("cols")
    if flag == "0" or (flag != "1" and not tuning.COLS):
        return "column-split norms off"
    return f"column-split norms at M <= {knob('cols_max_m') or tuning.COLS_MAX_M}"
