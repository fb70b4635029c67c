"""Where GPU kernels plug into the `k3::` ops.

A kernel registers itself for (op name, device type) with a predicate on the call (e.g. an M
range or a dtype); `pick` returns the first kernel whose predicate accepts the call, else None,
and the op runs its PyTorch reference. The device's kernel module (`k3compile.kernels.cuda`) is
imported lazily the first time an op runs on that device type, so CPU use never imports Triton.
"""
from __future__ import annotations

import importlib
from ..config import env, knob
from dataclasses import dataclass
from typing import Callable

_KERNELS: dict[tuple[str, str], list["Kernel"]] = {}
_LOADED: set[str] = set()


@dataclass
class Kernel:
    name: str
    fn: Callable
    accepts: Callable[..., bool]


def register(op: str, device: str, name: str, accepts: Callable[..., bool] | None = None):
    def deco(fn):
        _KERNELS.setdefault((op, device), []).append(Kernel(name, fn, accepts or (lambda *a, **k: True)))
        return fn
    return deco


def _load(device: str) -> None:
    if device in _LOADED:
        return
    _LOADED.add(device)
    if device == "cuda" and env("K3_KERNELS") != "0":
        try:
            importlib.import_module("k3compile.kernels.cuda")
        except ImportError:  # no Triton: every op runs its reference
            pass


def pick(op: str, device: str, *args, **kwargs) -> Kernel | None:
    _load(device)
    for k in _KERNELS.get((op, device), ()):
        if k.accepts(*args, **kwargs):
            return k
    return None


def registered(op: str | None = None) -> dict[tuple[str, str], list[str]]:
    return {key: [k.name for k in ks] for key, ks in _KERNELS.items() if op is None or key[0] == op}


def describe(device: str, group: str | None, moe: tuple | None = None) -> str | None:
    """One line for the match report: which communication path the CUDA kernels will take for
    `group` (None off CUDA, or when K3_KERNELS=0 leaves every op on its reference), and, given the
    routed experts' (I, L, K, M, bf16), which MXFP4 expert kernel runs (choose.experts_note)."""
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
            from .choose import oproj_note
            line += "; " + oproj_note()
    if moe is not None:
        from .choose import experts_note
        line += "; " + experts_note(*moe)
    return line


def _cols_note() -> str:
    """Where the all-reduce / norm and latent-tail kernels take their column-split forms."""
    from . import launch
    flag = knob("cols")
    if flag == "0" or (flag != "1" and not launch.COLS):
        return "column-split norms off"
    return f"column-split norms at M <= {knob('cols_max_m') or launch.COLS_MAX_M}"
