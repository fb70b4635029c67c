"""Where the MXFP4 experts' time goes at small batches: each CuTe kernel alone, the pair with and
without Programmatic Dependent Launch, and what a kernel that only *reads* the same bytes takes.

The read probes answer "how close to the bytes-over-bandwidth floor can any kernel get at this
size": a Triton kernel sums the bytes of each routed pair's expert (weights and scales of gate-up
and down, laid out contiguously per expert: the same byte count as the real tensors) as int32
words, one program per (pair, chunk), one value out per program. "read1" reads all of a call's
bytes in one kernel; "read2" reads the gate-up bytes, then the down bytes, in two kernels (the
boundary the CuTe pair has); "contig" reads as many bytes (every pair's, duplicates too) from
consecutive rows of one buffer (no gather).
Every case: K routings in turn call by call (--cold, as experts_bench), CUDA graph, events, median.

--tags T1,T2: also each variant of build.MXFP4_TAGS: its gate-up alone ("cute gate-up@T"), its down
alone where the tag has one ("cute down@T") and, unless it is a probe (wrong results: "nomath",
"noload", "ldgnm", "ldgnl"), the pair ("cute both pdl@T"); --no-read skips the read kernels.

    python bench/experts_probe.py [--shapes tp8,tp2] [--ms 1,2,4] [--cold 8] [--tags ldg,ldgnm,ldgnl] [--no-read] [--out F]
"""
from __future__ import annotations

import argparse
import os

from k3compile.config import knobs_text  # noqa: E402
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import BW_SEEN, hbm_bandwidth, save, time_graph  # noqa: E402
from bench.experts_bench import E, L, SHAPES, TOPK, expert_weights  # noqa: E402


def _read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_rows(src, ids, out, row_words, start, n_words, BLOCK: tl.constexpr):
        """out[p, c] = sum of int32 words [start + c * BLOCK, ...) of row ids[p] of src (row_words
        words per row), n_words words read per pair."""
        p = tl.program_id(0)
        c = tl.program_id(1)
        e = tl.load(ids + p).to(tl.int64)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(src + e * row_words + start + offs, mask=offs < n_words, other=0)
        tl.store(out + p * tl.num_programs(1) + c, tl.sum(v, 0))
    return read_rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="tp8,tp2")
    ap.add_argument("--ms", default="1,2,4")
    ap.add_argument("--cold", type=int, default=8)
    ap.add_argument("--blocks", default="2048,8192", help="int32 words per read program")
    ap.add_argument("--tags", default="", help="variants (build.MXFP4_TAGS) timed beside the default")
    ap.add_argument("--no-read", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch
    import triton

    from k3compile.kernels import moe
    from k3compile.kernels.cute import artifacts
    from k3compile.kernels.cute import build, loader
    os.environ["K3_KNOBS"] = knobs_text(cute_probe="1")         # find_mxfp4 serves the probe tags
    read_rows = _read_kernel()
    torch.manual_seed(0)
    bw = hbm_bandwidth()
    rows = []
    for shape in a.shapes.split(","):
        I = SHAPES[shape]
        w13, s13, w2, s2 = expert_weights(I)
        gu_bytes = w13[0].numel() + s13[0].numel()
        dn_bytes = w2[0].numel() + s2[0].numel()
        per_expert = gu_bytes + dn_bytes
        assert per_expert % 4 == 0 and gu_bytes % 4 == 0
        flat = torch.randint(-2 ** 31, 2 ** 31 - 1, (E, per_expert // 4), dtype=torch.int32, device="cuda")
        for M in [int(m) for m in a.ms.split(",")]:
            x = torch.randn(M, L, device="cuda").to(torch.bfloat16)
            routings = [torch.stack([torch.randperm(E, device="cuda")[:TOPK] for _ in range(M)]).to(torch.int32)
                        for _ in range(a.cold)]
            flat_ids = [r.reshape(-1).contiguous() for r in routings]
            P = M * TOPK
            distinct = sum(int(torch.unique(r).numel()) for r in routings) / a.cold
            nbytes = distinct * per_expert
            # as many bytes, pair after pair in one buffer: routing i reads rows i * P .. i * P + P - 1
            contig = torch.randint(-2 ** 31, 2 ** 31 - 1, (a.cold * P, per_expert // 4), dtype=torch.int32,
                                   device="cuda")
            contig_ids = [torch.arange(i * P, (i + 1) * P, dtype=torch.int32, device="cuda") for i in range(a.cold)]
            turn = iter(range(1 << 62))
            cases = {}
            for blk in ([] if a.no_read else [int(b) for b in a.blocks.split(",")]):
                def read(blk=blk, parts=((0, per_expert // 4),), src=flat, ids=flat_ids):
                    i = next(turn) % a.cold
                    for start, n in parts:
                        nc = triton.cdiv(n, blk)
                        out = torch.empty(P * nc, dtype=torch.int32, device="cuda")
                        read_rows[(P, nc)](src, ids[i], out, src.shape[1], start, n, BLOCK=blk,
                                           num_warps=8 if blk >= 4096 else 4)
                cases[f"read1 b{blk}"] = read
                cases[f"read2 b{blk}"] = (lambda blk=blk: read(blk, ((0, gu_bytes // 4),
                                                                     (gu_bytes // 4, dn_bytes // 4))))
                cases[f"contig b{blk}"] = (lambda blk=blk: read(blk, src=contig, ids=contig_ids))
            # the CuTe kernels (the artifacts dispatch picks for this batch: moe.mxfp4_tag)
            tag = moe.mxfp4_tag(I, M)
            for t in [None] + [t for t in a.tags.split(",") if t]:
                arts, why = loader.find_mxfp4(artifacts.artifact_dir(), I, L, TOPK, "f16x2", tag if t is None else t)
                if arts is None:
                    print("no CuTe artifacts:", why)
                    continue
                gu, dn = arts
                mid = torch.randn(P, I, device="cuda").to(torch.bfloat16)
                out = torch.empty(M, TOPK, L, dtype=torch.bfloat16, device="cuda")

                def launch(which, pdl=False, gu=gu, dn=dn, mid=mid, out=out):
                    ids = flat_ids[next(turn) % a.cold]
                    if "g" in which:
                        gu.launch_values(dict(x=x.data_ptr(), ids=ids.data_ptr(), w=w13.data_ptr(),
                                              s=s13.data_ptr(), out=mid.data_ptr(), beta=4.0, linear_beta=25.0),
                                         dict(P=P), x.device)
                    if "d" in which:
                        dn.launch_values(dict(x=mid.data_ptr(), ids=ids.data_ptr(), w=w2.data_ptr(),
                                              s=s2.data_ptr(), out=out.data_ptr(), beta=4.0, linear_beta=25.0),
                                         dict(P=P), x.device, pdl=pdl)
                if t is None:
                    cases["cute gate-up"] = lambda launch=launch: launch("g")
                    cases["cute down"] = lambda launch=launch: launch("d")
                    cases["cute both plain"] = lambda launch=launch: launch("gd")
                    cases["cute both pdl"] = lambda launch=launch: launch("gd", pdl=True)
                else:
                    cases[f"cute gate-up@{t}"] = lambda launch=launch: launch("g")
                    if "down" in build.MXFP4_TAGS[t]["modes"]:
                        cases[f"cute down@{t}"] = lambda launch=launch: launch("d")
                    if not build.MXFP4_TAGS[t].get("probe"):
                        cases[f"cute both pdl@{t}"] = lambda launch=launch: launch("gd", pdl=True)
            for name, fn in cases.items():
                t = time_graph(fn)
                b = (nbytes if name.startswith(("read", "cute both")) else
                     P * per_expert if name.startswith("contig") else
                     distinct * (gu_bytes if "gate-up" in name else dn_bytes))   # per call, as experts_bench
                rows.append(dict(shapes=shape, M=M, case=name, us=t, bytes=b, share=b / (t * 1e-6) / bw))
                print(f"probe {shape} M={M:<3} {name:<18} {t:8.2f} us {b / 1e6:8.1f} MB "
                      f"{b / (t * 1e-6) / 1e12:5.2f} TB/s = {100 * b / (t * 1e-6) / bw:3.0f}%", flush=True)
    save(a.out, dict(rows=rows, hbm_bytes_per_s=bw, bw_seen=BW_SEEN, gpu=torch.cuda.get_device_name(),
                     torch=torch.__version__, triton=triton.__version__))


if __name__ == "__main__":
    main()
