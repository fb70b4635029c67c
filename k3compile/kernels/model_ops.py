"""CUDA paths for the model's own ops (`k3model::*`), which every mode runs: eager, Inductor and k3.

`k3model::mla_decode`: the Triton MLA decode (kernels/triton_mla.py, launch.mla_decode) instead of the
op's PyTorch reference, where `launch.mla_decode_fits` takes the shapes. Off by default: it is
checked against the reference in Triton's CPU interpreter (tests/test_kernels.py) and has a GPU test
(tests/test_gpu.py), but has not run on a GPU yet. K3_MLA_TRITON=1 registers it (with
torch.library, for the CUDA dispatch key) when k3compile is imported, so the eager baseline of the
benchmarks gets it as well as the compiled modes (the best standalone kernel in every mode, as fla-core
is for the KDA decode). The model itself knows nothing of this module.
"""
from __future__ import annotations

import os

import torch

MLA_TRITON = os.environ.get("K3_MLA_TRITON", "0") == "1"


def mla_decode(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale) -> torch.Tensor:
    """k3model::mla_decode's CUDA kernel: the op's checks, then the Triton path where it fits, else the
    reference (which also mutates the cache)."""
    from ..model import attention_ops as A
    from . import launch
    A._validate_mla(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale, prefill=False)
    if launch.mla_decode_fits(q_lat, q_rope, kv_new, kv_cache):
        A._mla_check_lengths(seq_lens, 1, kv_cache.shape[1])   # data checks (skipped in a graph capture)
        return launch.mla_decode(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale)
    return A.mla_decode_reference(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale)


_DONE = False


def register() -> None:
    """Register the CUDA kernels above (once)."""
    global _DONE
    if _DONE:
        return
    from ..model import attention_ops  # noqa: F401  (defines k3model::mla_decode)
    torch.library.register_kernel("k3model::mla_decode", "cuda", mla_decode)
    _DONE = True


if MLA_TRITON:
    register()
