"""Run the MXFP4 expert kernels eagerly a few times, for Nsight Compute (ncu) to profile.

    ncu --clock-control none --kernel-name regex:mxfp4 --launch-skip 4 --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
        python3 bench/ncu_experts.py --variant cute_h2 --shape tp8 --m 16

Random weights (the experts_bench distribution), a different random routing each call (cold), no
CUDA graph (ncu profiles each launch on its own; its replay serialises kernels anyway, so the
numbers describe one kernel in isolation, not the PDL overlap)."""
from __future__ import annotations

import argparse
import os

from k3compile.config import knobs_text  # noqa: E402
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="cute_h2")
    ap.add_argument("--shape", default="tp8", choices=("tp8", "tp2"))
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--calls", type=int, default=4)
    a = ap.parse_args()
    import torch

    from bench.experts_bench import E, L, SHAPES, TOPK, expert_weights
    from k3compile.kernels import moe
    from k3compile.kernels.cute import artifacts
    v, _, tag = a.variant.partition("@")       # "cute_h2@TAG": an alternate (build --alt)
    if tag:
        os.environ["K3_KNOBS"] = knobs_text(cute_mxfp4_tag=tag)
    torch.manual_seed(0)
    w13, s13, w2, s2 = expert_weights(SHAPES[a.shape])
    x = torch.randn(a.m, L, device="cuda").to(torch.bfloat16)
    for _ in range(a.calls):
        ids = torch.stack([torch.randperm(E, device="cuda")[:TOPK] for _ in range(a.m)]).to(torch.int32)
        moe.mxfp4_experts(x, ids, w13, s13, w2, s2, 4.0, 25.0, variant=v)
    torch.cuda.synchronize()
    if artifacts.fallbacks():
        raise SystemExit(f"fell back: {artifacts.fallbacks()}")
    print("ok", a)


if __name__ == "__main__":
    main()
