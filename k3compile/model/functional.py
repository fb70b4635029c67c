"""Plain PyTorch math shared by the model and the reference implementations.

Everything here is the spec's math (../shared/K3-SPEC.md, section 1-2), written once.
"""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32, returned in x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def situ(gate_up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU over a concatenated [gate | up] last dim (fp32 math, returned in input dtype).

    gate' = beta * tanh(gate / beta) * sigmoid(gate); up' = lb * tanh(up / lb); out = gate' * up'.
    """
    gate, up = gate_up.float().chunk(2, dim=-1)
    g = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    u = linear_beta * torch.tanh(up / linear_beta)
    return (g * u).to(gate_up.dtype)


def situ_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
             beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU MLP over F.linear weights: down(SiTU(x @ [gate; up].T))."""
    return torch.nn.functional.linear(situ(torch.nn.functional.linear(x, w_gate_up), beta, linear_beta), w_down)


def attnres_mix(prefix, delta, blocks, w_norm, w_qk, g_out, eps):
    """AttnRes mixer (spec section 2). Returns (normalised output, updated residual)."""
    updated = prefix if delta is None else prefix + delta
    if blocks:
        srcs = torch.stack([*blocks, updated], dim=0)  # [S, N, H]
        logits = (rms_norm(srcs, None, eps).float() * (w_norm.float() * w_qk.float())).sum(-1)
        p = torch.softmax(logits, dim=0)
        mixed = (p.unsqueeze(-1) * srcs.float()).sum(0).to(updated.dtype)
    else:
        mixed = updated
    return rms_norm(mixed, g_out, eps), updated
