"""Other ways of writing the same K3 layer, to check the patterns match however it is written.

`apply(style)` rebinds the model's building blocks (the model module itself is unchanged):
- "matmul":  `x @ w.t()` instead of F.linear, and `torch.nn.functional.rms_norm` instead of the
  hand-written RMSNorm;
- "inplace": in-place `dist.all_reduce` instead of functional collectives, and RMSNorm written
  as `x / sqrt(mean(x*x) + eps)`;
- "vllm": vLLM's op forms, `torch.ops.vllm.all_reduce(x, group_name)` and
  `torch.ops.vllm_ir.rms_norm(x, weight, epsilon)` (look-alike ops with vLLM's schemas, registered
  here when vLLM is not installed).
- "vllm_add_norm": "vllm", and the AttnRes residual add + norm (no blocks yet) written as vLLM's
  `(normed, residual) = torch.ops.vllm_ir.fused_add_rms_norm(x, residual, weight, epsilon)` (look-alike
  when vLLM is not installed; it rounds like vLLM's CUDA kernel).
- "online_softmax": the AttnRes mixer's softmax as Inductor's post-grad pass rewrites it on CUDA
  (`max, sum = prims.prepare_softmax_online(logits, 0)`, then `exp(logits - max) / sum`), which CPU
  graphs never get from Inductor itself;
- "vllm_c_v1" / "vllm_c_v2": "vllm", with that add + norm as vLLM's in-place CUDA op
  `torch.ops._C.fused_add_rms_norm(input!, residual!, weight, epsilon)` and every other RMSNorm as
  `torch.ops._C.rms_norm(result!, input, weight, epsilon)` (look-alikes with the schemas of vLLM 0.33's
  `_C` library, which does not load without CUDA), so the graph holds them wrapped in
  `auto_functionalized` (v1, as vLLM configures Inductor) or `auto_functionalized_v2` (torch's default).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from k3compile.model.functional import rms_norm as _K3_RMS_NORM  # the model's own, before apply() rebinds it


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


def _register_vllm_add_norm_lookalikes() -> None:
    if not hasattr(torch.ops, "vllm_ir") or not hasattr(torch.ops.vllm_ir, "fused_add_rms_norm"):
        @torch.library.custom_op("vllm_ir::fused_add_rms_norm", mutates_args=())
        def fused_add_rms_norm(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None,
                               epsilon: float, variance_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            # rounds like vLLM's CUDA kernel (the sum in the model dtype is normalised), so the
            # rewritten graph is compared bit-exactly; vLLM's native implementation normalises the
            # fp32 sum instead (tests/test_vllm.py checks against it in fp32)
            updated = x_residual + x
            return _K3_RMS_NORM(updated, weight, epsilon), updated

        fused_add_rms_norm.register_fake(lambda x, r, w, eps, vs=None: (torch.empty_like(x), torch.empty_like(x)))
    global _C_LIB
    _C_LIB = _C_LIB or torch.library.Library("_C", "FRAGMENT")
    if not hasattr(torch.ops._C, "fused_add_rms_norm"):
        _C_LIB.define("fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor? weight, float epsilon) -> ()")

        def c_fused_add_rms_norm(input, residual, weight, epsilon):
            # like vLLM's CUDA kernel: the sum rounded to the model dtype is the new residual and is normalised
            residual.add_(input)
            input.copy_(_K3_RMS_NORM(residual, weight, epsilon))

        _C_LIB.impl("fused_add_rms_norm", c_fused_add_rms_norm, "CompositeExplicitAutograd")
        _C_LIB._register_fake("fused_add_rms_norm", lambda input, residual, weight, epsilon: None)
    if not hasattr(torch.ops._C, "rms_norm"):
        _C_LIB.define("rms_norm(Tensor! result, Tensor input, Tensor? weight, float epsilon) -> ()")

        def c_rms_norm(result, input, weight, epsilon):
            result.copy_(_K3_RMS_NORM(input, weight, epsilon))

        _C_LIB.impl("rms_norm", c_rms_norm, "CompositeExplicitAutograd")
        _C_LIB._register_fake("rms_norm", lambda result, input, weight, epsilon: None)


_C_LIB = None


def _attnres_fused(fused_add):
    from k3compile.model import functional

    def mix(prefix, delta, blocks, w_norm, w_qk, g_out, eps):
        if delta is not None and not blocks:
            return fused_add(delta, prefix, g_out, eps)  # (normalised output, updated residual)
        return functional.attnres_mix(prefix, delta, blocks, w_norm, w_qk, g_out, eps)
    return mix


def _attnres_online_softmax(prefix, delta, blocks, w_norm, w_qk, g_out, eps):
    """functional.attnres_mix with the softmax over the sources in Inductor's CUDA online form."""
    from k3compile.model.functional import rms_norm
    from torch._inductor import inductor_prims  # noqa: F401  (registers prims.prepare_softmax_online)
    updated = prefix if delta is None else prefix + delta
    if not blocks:
        return rms_norm(updated, g_out, eps), updated
    srcs = torch.stack([*blocks, updated], dim=0)
    logits = (rms_norm(srcs, None, eps).float() * (w_norm.float() * w_qk.float())).sum(-1)
    mx, sm = torch.ops.prims.prepare_softmax_online(logits, 0)
    p = torch.exp(logits - mx) / sm
    mixed = (p.unsqueeze(-1) * srcs.float()).sum(0).to(updated.dtype)
    return rms_norm(mixed, g_out, eps), updated


def _fused_add_vllm_ir(x, residual, weight, eps):
    return torch.ops.vllm_ir.fused_add_rms_norm(x, residual, weight, eps)


def _rms_norm_c(x, weight, eps):
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, weight, eps)
    return out


def _fused_add_c(x, residual, weight, eps):
    torch.ops._C.fused_add_rms_norm(x, residual, weight, eps)  # x <- normed, residual <- residual + x
    return x, residual


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
    elif style in ("vllm_add_norm", "vllm_c_v1", "vllm_c_v2"):
        apply("vllm")
        _register_vllm_add_norm_lookalikes()
        layers.attnres_mix = _attnres_fused(_fused_add_vllm_ir if style == "vllm_add_norm" else _fused_add_c)
        if style != "vllm_add_norm":
            torch._inductor.config.enable_auto_functionalized_v2 = style == "vllm_c_v2"
            layers.rms_norm = _rms_norm_c
            functional.__dict__["rms_norm"] = _rms_norm_c
    elif style == "online_softmax":
        layers.attnres_mix = _attnres_online_softmax
    elif style != "reference":
        raise ValueError(style)
