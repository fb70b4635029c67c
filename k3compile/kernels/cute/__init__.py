"""CuTe DSL kernels for sm_90a, compiled ahead of time, or just in time where the DSL is installed (issue 6).

- `skinny_gemm.py`: the decode o-proj GEMM (swap-AB, TMA + wgmma, S-stage mbarrier pipeline),
  plain and with the push all-reduce epilogue (partials into every rank's symmetric buffer, per-tile
  release flags). Imports the DSL: only `build.py` imports it (AOT build and JIT build).
- `ptx.py`: the inline-PTX helpers both kernel files use.
- `mxfp4_experts.py`: the MXFP4 routed-expert GEMVs (gate-up with SiTU fused, down) for decode:
  CUDA cores, cp.async-staged 16-byte weight vectors, two-codes-per-IMAD dequantisation, fp32
  FMAs; `mxfp4_ref.py` is its PyTorch emulation for CPU tests (no DSL).
- `build.py`: `python -m k3compile.kernels.cute.build [--out DIR]` compiles every kernel for
  sm_90a on a machine with no GPU (fake tensors) into a cubin + PTX + JSON manifest per variant,
  cached by (kernel source, shapes / tile config, DSL version). `build.ensure` builds one
  variant the same way: the JIT path, which `artifacts.find` takes on first use when the DSL is
  installed and no artifact fits (`K3_KNOBS=cute_jit=0` turns it off; never inside a CUDA graph
  capture). Run on the H200 with the DSL installed there (BENCHMARKS.md).
- `loader.py`: loads a cubin with the CUDA driver and launches it (no DSL at run time).
- `artifacts.py`: CuTe or the default path per op and M: which artifact serves a call, and why none did.

Nothing here imports the DSL at package import time.
"""
from __future__ import annotations

import importlib.util


def dsl_available() -> bool:
    """True when nvidia-cutlass-dsl is importable (needed only to build or JIT, not to launch)."""
    return importlib.util.find_spec("cutlass") is not None and importlib.util.find_spec("cutlass.cute") is not None
