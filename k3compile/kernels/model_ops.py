"""CUDA paths for the model's own ops (`k3model::*`), which every mode runs: eager, Inductor and k3.

`k3model::mla_decode`: the Triton MLA decode (kernels/triton_mla.py, attention.mla_decode) instead of the
op's PyTorch reference, where `attention.mla_decode_fits` takes the shapes. It is checked against the
reference in Triton's CPU interpreter (tests/test_kernels.py) and on the H200 (tests/test_gpu.py,
bf16, graphed). On by default: importing k3compile registers it (with torch.library, for the CUDA
dispatch key; K3_KNOBS=mla_triton=0 leaves the reference), so the eager baseline of the benchmarks gets it
as well as the compiled modes (the best standalone kernel in every mode, as fla-core is for the KDA
decode). One H200, MLA layer at TP=8 widths, context 1024, the same call
(bench/results/layer_mla_tp8_w1_h200_a0b32af{,_triton}.json): k3 238.2 -> 169.3 us at M=1, 273.0 ->
181.9 at 4, 458.6 -> 279.7 at 16; Inductor 286.2 -> 218.5 at M=1. The model itself knows nothing of
this module. It belongs to the attention family (kernels/attention.py) but imports no Triton until the
first call, so `import k3compile` can register it.
"""
from __future__ import annotations

from ..config import knob

import torch

MLA_TRITON = knob("mla_triton", "1") != "0"


def mla_decode(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale) -> torch.Tensor:
    """k3model::mla_decode's CUDA kernel: the op's checks, then the Triton path where it fits, else the
    reference (which also mutates the cache)."""
    from ..model import attention_ops as A
    from . import attention
    A.validate_mla(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale, prefill=False)
    if attention.mla_decode_fits(q_lat, q_rope, kv_new, kv_cache):
        A.mla_check_lengths(seq_lens, 1, kv_cache.shape[1])   # data checks (skipped in a graph capture)
        return attention.mla_decode(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale)
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
