"""Other ways of writing the same K3 layer, to check the patterns match however it is written.

`apply(style)` rebinds the model's building blocks (the model module itself is unchanged):
- "matmul":  `x @ w.t()` instead of F.linear, and `torch.nn.functional.rms_norm` instead of the
  hand-written RMSNorm;
- "inplace": in-place `dist.all_reduce` instead of functional collectives, and RMSNorm written
  as `x / sqrt(mean(x*x) + eps)`;
- "vllm": vLLM's op forms, `torch.ops.vllm.all_reduce(x, group_name)` and
  `torch.ops.vllm_ir.rms_norm(x, weight, epsilon)` (look-alike ops with vLLM's schemas, registered
  here when vLLM is not installed).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _linear_matmul(x, w, bias=None):
    y = torch.matmul(x, w.t())
    return y if bias is None else y + bias


def _rms_norm_torch(x, weight, eps):
    w = None if weight is None else weight.float()
    return F.rms_norm(x.float(), (x.shape[-1],), w, eps).to(x.dtype)


def _rms_norm_div(x, weight, eps):
    xf = x.float()
    y = xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def _all_reduce_inplace(x, tp):
    if tp.size == 1:
        return x
    x = x.clone()
    dist.all_reduce(x)
    return x


class _FProxy:
    """`F` as seen by layers.py, with `linear` swapped."""

    def __init__(self, linear):
        self._linear = linear

    def __getattr__(self, name):
        return self._linear if name == "linear" else getattr(F, name)


def _register_vllm_lookalikes() -> None:
    if not hasattr(torch.ops, "vllm") or not hasattr(torch.ops.vllm, "all_reduce"):
        @torch.library.custom_op("vllm::all_reduce", mutates_args=())
        def all_reduce(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
            out = torch.ops._c10d_functional.all_reduce(tensor.contiguous(), "sum", group_name)
            return torch.ops._c10d_functional.wait_tensor(out)

        all_reduce.register_fake(lambda tensor, group_name: torch.empty_like(tensor))
    if not hasattr(torch.ops, "vllm_ir") or not hasattr(torch.ops.vllm_ir, "rms_norm"):
        @torch.library.custom_op("vllm_ir::rms_norm", mutates_args=())
        def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                     variance_size: int | None = None) -> torch.Tensor:
            return _rms_norm_torch(x, weight, epsilon)

        rms_norm.register_fake(lambda x, weight, epsilon, variance_size=None: torch.empty_like(x))


def _all_reduce_vllm(x, tp):
    return x if tp.size == 1 else torch.ops.vllm.all_reduce(x, tp.group_name)


def _rms_norm_vllm(x, weight, eps):
    return torch.ops.vllm_ir.rms_norm(x, weight, eps)


def apply(style: str) -> None:
    from k3compile.model import functional, layers
    if style == "matmul":
        layers.F = _FProxy(_linear_matmul)
        layers.rms_norm = functional.rms_norm = _rms_norm_torch
        functional.__dict__["rms_norm"] = _rms_norm_torch
    elif style == "inplace":
        layers.all_reduce = _all_reduce_inplace
        layers.rms_norm = _rms_norm_div
        functional.__dict__["rms_norm"] = _rms_norm_div
    elif style == "vllm":
        _register_vllm_lookalikes()
        layers.all_reduce = _all_reduce_vllm
        layers.rms_norm = _rms_norm_vllm
        functional.__dict__["rms_norm"] = _rms_norm_vllm
    elif style != "reference":
        raise ValueError(style)
