"""Routed-expert custom op of the K3 LatentMoE (K3-SPEC.md section 2, step 5).

``torch.ops.k3model.mxfp4_experts(x, topk_ids, w13, w13_scale, w2, w2_scale, beta, linear_beta)``

* ``x`` [N, L] latent activations (bf16 / fp16 / fp32)
* ``topk_ids`` [N, k] int32 / int64 expert ids in [0, E)
* ``w13`` [E, 2I, L//2] uint8 MXFP4 (rows 0..I-1 gate, I..2I-1 up), ``w13_scale`` [E, 2I, L//32] uint8
* ``w2`` [E, L, I//2] uint8 MXFP4, ``w2_scale`` [E, L, I//32] uint8
* returns [N, k, L] in x.dtype, UNWEIGHTED and unfinalised:
  ``out[n, j] = W2[e] @ situ(W13[e] @ x[n], beta, linear_beta)`` with ``e = topk_ids[n, j]``,
  all math in fp32. I is whatever slice of the expert intermediate the caller holds (under
  tensor parallelism the per-rank slice, so the result is a TP-partial sum).

The reference implementation here is plain PyTorch: it dequantises only the experts that
are actually used and runs one batched GEMM pair per used expert.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from k3compile.model.functional import situ
from k3compile.model.mxfp4 import BLOCK, _dequantize, _is_real_tensor, dequantize

__all__ = ["mxfp4_experts", "dequantize_experts", "mxfp4_experts_reference", "mxfp4_experts_gathered"]

_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ID_DTYPES = (torch.int32, torch.int64)


def _validate(x: Tensor, topk_ids: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor,
              w2_scale: Tensor, beta: float, linear_beta: float, *, check_values: bool) -> None:
    """Metadata checks always; value (data-dependent) checks only if ``check_values``."""
    fn = "mxfp4_experts"
    # dtypes
    if x.dtype not in _X_DTYPES:
        raise TypeError(f"{fn}: x must be bfloat16, float16 or float32, got {x.dtype}")
    if topk_ids.dtype not in _ID_DTYPES:
        raise TypeError(f"{fn}: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        if t.dtype != torch.uint8:
            raise TypeError(f"{fn}: {name} must be uint8 (packed MXFP4 / E8M0 bytes), got {t.dtype}")
    # ranks
    for name, t, want, layout in (
        ("x", x, 2, "[N, L]"),
        ("topk_ids", topk_ids, 2, "[N, k]"),
        ("w13", w13, 3, "[E, 2*I, L//2]"),
        ("w13_scale", w13_scale, 3, "[E, 2*I, L//32]"),
        ("w2", w2, 3, "[E, L, I//2]"),
        ("w2_scale", w2_scale, 3, "[E, L, I//32]"),
    ):
        if t.dim() != want:
            raise ValueError(f"{fn}: {name} must be {want}-D {layout}, got shape {tuple(t.shape)}")
    # devices
    for name, t in (("topk_ids", topk_ids), ("w13", w13), ("w13_scale", w13_scale),
                    ("w2", w2), ("w2_scale", w2_scale)):
        if t.device != x.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but x is on {x.device}")
    # shapes
    N, L = x.shape
    if topk_ids.shape[0] != N:
        raise ValueError(
            f"{fn}: topk_ids has {topk_ids.shape[0]} rows but x has N={N} (x {tuple(x.shape)}, "
            f"topk_ids {tuple(topk_ids.shape)})"
        )
    if L % BLOCK != 0:
        raise ValueError(f"{fn}: x latent dim L={L} must be a multiple of {BLOCK} (MXFP4 blocks)")
    E, two_i, half_l = w13.shape
    if half_l * 2 != L:
        raise ValueError(
            f"{fn}: w13 shape {tuple(w13.shape)} does not match x latent dim L={L}: "
            f"expected w13.shape[2] == L//2 == {L // 2}"
        )
    if two_i % 2 != 0:
        raise ValueError(f"{fn}: w13.shape[1] must be 2*I (gate|up), got odd {two_i}")
    inter = two_i // 2
    if inter <= 0 or inter % BLOCK != 0:
        raise ValueError(
            f"{fn}: expert intermediate I={inter} (from w13 shape {tuple(w13.shape)}) must be "
            f"a positive multiple of {BLOCK}"
        )
    for name, t, expected in (
        ("w13_scale", w13_scale, (E, two_i, L // BLOCK)),
        ("w2", w2, (E, L, inter // 2)),
        ("w2_scale", w2_scale, (E, L, inter // BLOCK)),
    ):
        if tuple(t.shape) != expected:
            raise ValueError(
                f"{fn}: {name} shape {tuple(t.shape)} does not match; expected {expected} "
                f"(E={E}, L={L}, I={inter})"
            )
    for name, v in (("beta", beta), ("linear_beta", linear_beta)):
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v == 0:
            raise ValueError(f"{fn}: {name} must be a finite non-zero float, got {v!r}")
    # data-dependent: only on real tensors
    if check_values and topk_ids.numel() > 0 and _is_real_tensor(topk_ids):
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= E:
            raise ValueError(
                f"{fn}: topk_ids values must be in [0, E={E}), got min {lo} and max {hi}"
            )


def dequantize_experts(w: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Dequantise stacked expert weights [E, R, C//2] / [E, R, C//32] -> [E, R, C] in ``dtype``."""
    if not isinstance(w, Tensor) or w.dim() != 3:
        raise ValueError(
            f"dequantize_experts: w must be a 3-D [E, R, C//2] tensor, got "
            f"{tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__}"
        )
    return dequantize(w, scale, dtype)


def mxfp4_experts_reference(x: Tensor, topk_ids: Tensor, w13: Tensor, w13_scale: Tensor,
                            w2: Tensor, w2_scale: Tensor, beta: float,
                            linear_beta: float) -> Tensor:
    """Unchecked plain-PyTorch implementation (what the op's real kernel runs)."""
    N, k = topk_ids.shape
    L = x.shape[1]
    out = torch.zeros(N * k, L, dtype=torch.float32, device=x.device)
    if N * k == 0:
        return out.view(N, k, L).to(x.dtype)
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)  # (token, slot) rows grouped by expert
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    xf = x.to(torch.float32)
    start = 0
    for e, c in zip(experts.tolist(), counts.tolist()):
        rows = order[start:start + c]
        start += c
        xe = xf.index_select(0, rows // k)                      # [c, L]
        w13_e = _dequantize(w13[e], w13_scale[e], torch.float32)  # [2I, L]
        mid = situ(xe @ w13_e.t(), beta, linear_beta)           # [c, I] fp32
        w2_e = _dequantize(w2[e], w2_scale[e], torch.float32)    # [L, I]
        out.index_copy_(0, rows, mid @ w2_e.t())
    return out.view(N, k, L).to(x.dtype)


@torch.library.custom_op("k3model::mxfp4_experts", mutates_args=())
def mxfp4_experts(x: Tensor, topk_ids: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor,
                  w2_scale: Tensor, beta: float, linear_beta: float) -> Tensor:
    """Unweighted routed-expert outputs [N, k, L] in x.dtype (see module docstring)."""
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    # no host syncs while a CUDA graph is captured: skip the id-range check, use the gather path
    _validate(x, topk_ids, w13, w13_scale, w2, w2_scale, beta, linear_beta, check_values=not capturing)
    fn = mxfp4_experts_gathered if capturing else mxfp4_experts_reference
    return fn(x, topk_ids, w13, w13_scale, w2, w2_scale, beta, linear_beta)


def mxfp4_experts_gathered(x: Tensor, topk_ids: Tensor, w13: Tensor, w13_scale: Tensor,
                           w2: Tensor, w2_scale: Tensor, beta: float, linear_beta: float) -> Tensor:
    """Same result without host syncs (capturable): dequantise each (token, slot)'s expert."""
    N, k = topk_ids.shape
    flat = topk_ids.reshape(-1).to(torch.int64)
    xe = x.to(torch.float32).repeat_interleave(k, dim=0).unsqueeze(-1)           # [Nk, L, 1]
    w13_e = _dequantize(w13[flat], w13_scale[flat], torch.float32)               # [Nk, 2I, L]
    mid = situ(torch.bmm(w13_e, xe).squeeze(-1), beta, linear_beta).unsqueeze(-1)  # [Nk, I, 1]
    w2_e = _dequantize(w2[flat], w2_scale[flat], torch.float32)                  # [Nk, L, I]
    return torch.bmm(w2_e, mid).view(N, k, x.shape[1]).to(x.dtype)


@mxfp4_experts.register_fake
def _mxfp4_experts_fake(x: Tensor, topk_ids: Tensor, w13: Tensor, w13_scale: Tensor,
                        w2: Tensor, w2_scale: Tensor, beta: float,
                        linear_beta: float) -> Tensor:
    _validate(x, topk_ids, w13, w13_scale, w2, w2_scale, beta, linear_beta, check_values=False)
    return x.new_empty(topk_ids.shape[0], topk_ids.shape[1], x.shape[1])
