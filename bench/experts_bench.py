"""MXFP4 routed-expert kernels at real K3 shapes: time, bytes, share of measured HBM bandwidth.

Per-rank shapes of TP=8 (I=384) and TP=2 (I=1536), latent L=3584, 896 experts, top-16, tokens
routed to random distinct experts; M in {1, 4, 16, 64, 256}. Times (CUDA graph, events, median):
  k3         - the Triton kernels (k3::mxfp4_experts' CUDA dispatch);
  reference  - the model op's capture-safe PyTorch path (dequantise each pair's expert + bmm).
Bytes = the MXFP4 weights and scales of the distinct experts used (what the op must read);
bandwidth share = bytes / time / measured HBM bandwidth (a 1 GiB device copy, read + write).

    python bench/experts_bench.py [--ms 1,4,16,64,256] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.ops_bench import BW_SEEN, _hbm_bandwidth, _time_graph  # noqa: E402

L, E, TOPK = 3584, 896, 16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,4,16,64,256")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from k3compile.kernels import launch
    from k3compile.model.moe_ops import mxfp4_experts_gathered
    torch.manual_seed(0)
    bw = _hbm_bandwidth()
    rows = []
    for shape, I in (("tp8", 384), ("tp2", 1536)):
        w13 = torch.randint(0, 256, (E, 2 * I, L // 2), dtype=torch.uint8, device="cuda")
        s13 = torch.randint(118, 124, (E, 2 * I, L // 32), dtype=torch.uint8, device="cuda")
        w2 = torch.randint(0, 256, (E, L, I // 2), dtype=torch.uint8, device="cuda")
        s2 = torch.randint(118, 124, (E, L, I // 32), dtype=torch.uint8, device="cuda")
        per_expert = (w13[0].numel() + s13[0].numel() + w2[0].numel() + s2[0].numel())
        for M in [int(m) for m in a.ms.split(",")]:
            x = torch.randn(M, L, device="cuda").to(torch.bfloat16)
            ids = torch.stack([torch.randperm(E, device="cuda")[:TOPK] for _ in range(M)]).to(torch.int32)
            distinct = int(torch.unique(ids).numel())
            nbytes = distinct * per_expert
            k3 = lambda: launch.mxfp4_experts(x, ids, w13, s13, w2, s2, 4.0, 25.0)  # noqa: E731
            ref = lambda: mxfp4_experts_gathered(x, ids, w13, s13, w2, s2, 4.0, 25.0)  # noqa: E731
            out = k3()
            sub = slice(0, min(M, 4))  # the reference on a few tokens (it materialises fp32 weights)
            want = mxfp4_experts_gathered(x[sub], ids[sub], w13, s13, w2, s2, 4.0, 25.0)
            err = ((out[sub].float() - want.float()).abs().max() / want.float().abs().max()).item()
            t_k3 = _time_graph(k3)
            t_ref = _time_graph(ref, reps=2, iters=5) if M * I <= 16 * 384 else None  # it materialises fp32 weights
            row = dict(shapes=shape, M=M, I=I, distinct_experts=distinct, bytes=nbytes, k3_us=t_k3,
                       reference_us=t_ref, err_vs_reference=err, k3_bytes_per_s=nbytes / (t_k3 * 1e-6),
                       hbm_share=nbytes / (t_k3 * 1e-6) / bw, floor_us=nbytes / bw * 1e6)
            rows.append(row)
            print(f"experts {shape} M={M:<4} distinct={distinct:<4} k3={t_k3:8.1f}us ref={t_ref or float('nan'):9.1f}us "
                  f"{nbytes / 1e6:7.1f} MB  {row['k3_bytes_per_s'] / 1e12:.2f} TB/s = {row['hbm_share'] * 100:.0f}% of "
                  f"{bw / 1e12:.2f} TB/s  err {err:.2e}", flush=True)
    out = dict(rows=rows, hbm_bytes_per_s=bw, bw_seen=BW_SEEN, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               command="python bench/experts_bench.py " + " ".join(sys.argv[1:]), date=time.strftime("%Y-%m-%d"),
               commit=os.environ.get("K3_COMMIT", "unknown"))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
