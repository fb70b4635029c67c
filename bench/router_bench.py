"""Router top-k selection: k3::router_topk's Triton kernel vs the unfused sequence, one GPU, graphed.

Times at M in --ms (E = 896 experts, top-16, fp32 logits as the router GEMM's output is upcast):
  eager     - the model's route(): sigmoid, + bias, torch.topk, gather, sum, div, * scale
  inductor  - the same through torch.compile(backend="inductor")
  k3 wN     - the k3 kernel (one packed-key reduction per round) with num_warps N
  k3 sort wN - the k3 kernel's SORT form (Triton's bitonic tl.topk over the packed keys)
  v1 w4     - the first kernel (three reductions per round), kept here only as the before-point
Every variant's ids must equal eager's (random logits: no ties) and its weights match to 1e-5.

    python bench/router_bench.py [--ms 1,4,16,64,256] [--out r.json]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import save, time_graph  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _v1_kernel(logits, bias, ids, w, E, scale, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < E
    s = tl.sigmoid(tl.load(logits + r * E + offs, mask=m, other=0.0).to(tl.float32))
    v = tl.where(m, s + tl.load(bias + offs, mask=m, other=0.0).to(tl.float32), float("-inf"))
    kk = tl.arange(0, KP)
    sel = tl.zeros([KP], tl.int32)
    ws = tl.zeros([KP], tl.float32)
    for j in tl.static_range(K):
        top = tl.max(v, 0)
        i = tl.min(tl.where(v == top, offs, BLOCK), 0)
        i = tl.where(i < E, i, 0)
        sel = tl.where(kk == j, i, sel)
        ws = tl.where(kk == j, tl.sum(tl.where(offs == i, s, 0.0), 0), ws)
        v = tl.where(offs == i, float("-inf"), v)
    tot = tl.sum(ws, 0)
    tl.store(ids + r * K + kk, sel.to(tl.int64), mask=kk < K)
    tl.store(w + r * K + kk, ws / tot * scale, mask=kk < K)


def main():
    import torch

    from k3compile.kernels import triton_router as KR
    from k3compile.ops import reference as ref
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,4,16,64,256")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    E, K, scale = 896, 16, 2.5
    dev = torch.device("cuda")
    bias = torch.randn(E, device=dev) * 0.1
    rows = []
    for M in [int(m) for m in a.ms.split(",")]:
        logits = torch.randn(M, E, device=dev) * 2
        ids, w = torch.empty(M, K, dtype=torch.int64, device=dev), torch.empty(M, K, device=dev)

        def launch(kern, warps, **kw):
            def f():
                kern[(M,)](logits, bias, ids, w, E, scale, K=K, KP=16, BLOCK=1024, num_warps=warps, **kw)
                return ids, w
            return f
        variants = {"eager": lambda: ref.router_topk(logits, bias, K, scale),
                    "inductor": torch.compile(lambda: ref.router_topk(logits, bias, K, scale), fullgraph=True)}
        for nw in (1, 2, 4, 8):
            variants[f"k3 w{nw}"] = launch(KR.router_topk_kernel, nw)
        for nw in (1, 2, 4, 8, 16):
            variants[f"k3 sort w{nw}"] = launch(KR.router_topk_kernel, nw, SORT=True)
        variants["v1 w4"] = launch(_v1_kernel, 4)
        rid, rw = ref.router_topk(logits, bias, K, scale)
        row = dict(M=M, E=E, K=K, us={}, ok={})
        for name, fn in variants.items():
            i, ww = fn()
            row["ok"][name] = bool(torch.equal(i, rid)) and bool(torch.allclose(ww, rw, atol=1e-5, rtol=1e-5))
            row["us"][name] = time_graph(fn)
        rows.append(row)
        print(M, {k: round(v, 2) for k, v in row["us"].items()}, "all ok" if all(row["ok"].values()) else row["ok"],
              flush=True)
    if a.out:
        save(a.out, dict(rows=rows, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                             triton=triton.__version__))


if __name__ == "__main__":
    main()
