"""The o-proj and latent-tail ops' kernels on ONE GPU, as rank 0 of a simulated TP group
(tests/simpeers.py: the peers' partials in ordinary buffers on this GPU, their barrier signals set
before), each option of the communication kernels side by side: what the kernels themselves cost
without NVLink and without a peer's skew. Not a substitute for bench/ops_bench.py on two GPUs
(the one-shot all-reduce's NVLink trips and the baselines are there); it separates the local part.

Variants (kernels/comm.py and kernels/tuning.py settings; every variant in the same run, cold weights: `--cold` copies):
  k3           the defaults (early reads, one vector atomic to signal / poll the peers)
  k3_late      peer-independent reads after the barrier wait (COMM_EARLY=0)
  k3_loop      the peers signalled and polled one after another (COMM_VEC=0)
  k3_before    both: the kernels before COMM_EARLY / COMM_VEC
  gemm         the op's GEMM alone (torch.mm, cold)
  k3_fat / k3_lean  (oproj, resnorm) the all-reduce + norm kernel without / with comm.AR_LEAN at
               every group size (the default: by group size, comm._ar_form); before that default "k3" was lean
  k3_w8/_w16/_w32  (oproj, resnorm) that kernel with 8 / 16 / 32 warps (comm.AR_WARPS; the default
               by width, 16 at group size >= 8 and M=1)
  k3_fat_w16   both
  k3_seq / k3_seq_w16 / k3_seq_w32  the AttnRes sources one after another (comm.AR_JOINT=False; the
               default: joint at group size 1 only), with the warps by width / 16 / 32
  k3_joint / k3_joint_w32  the joint reductions at every group size (AR_JOINT=True)
  (op resnorm, the layer-input k3::residual_norm with `--blocks` AttnRes blocks, at every world;
  the o-proj op with `--oproj-blocks` (default 0: a plain RMSNorm after the all-reduce))
`--worlds` may include 1: the same ops at TP=1 (no buffer, no barrier), the kernels' local work.

    python bench/comm_sim_bench.py [--worlds 2,8] [--ms 1,4,16,64] [--cold 8] [--ops oproj,tail,resnorm] [--out F]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import GraphTimer, save, with_attrs  # noqa: E402

VARIANTS = {"k3": {}, "k3_late": {"COMM_EARLY": False}, "k3_loop": {"COMM_VEC": False},
            "k3_before": {"COMM_EARLY": False, "COMM_VEC": False}}
# the all-reduce + norm kernel's register footprint and warps (both ops that run it: oproj, resnorm)
AR_VARIANTS = {"k3_fat": {"AR_LEAN": False}, "k3_lean": {"AR_LEAN": True}, "k3_w8": {"AR_WARPS": 8},
               "k3_w16": {"AR_WARPS": 16}, "k3_w32": {"AR_WARPS": 32}, "k3_fat_w16": {"AR_LEAN": False, "AR_WARPS": 16},
               "k3_seq": {"AR_JOINT": False}, "k3_seq_w16": {"AR_JOINT": False, "AR_WARPS": 16},
               "k3_seq_w32": {"AR_JOINT": False, "AR_WARPS": 32}, "k3_joint": {"AR_JOINT": True},
               "k3_joint_w32": {"AR_JOINT": True, "AR_WARPS": 32},
               "k3_w1_late": {"AR_W1_FIRST": False}}  # group size 1: the block rows loaded after the store
# the layer-input op (resnorm): the defaults (its AttnRes block rows loaded together: AR_PRELOAD) and
# AR_VARIANTS; before AR_PRELOAD's default "k3" was the kernel without the preload and k3_preload the one with it
RESNORM_VARIANTS = {"k3": {}, **AR_VARIANTS}
# every op: the column-split kernels (triton_cols, tuning.COLS, the default at M <= COLS_MAX_M) with other
# widths, and the row kernels
COLS_VARIANTS = {"k3_rows": {"COLS": False}, "k3_c64": {"COLS_W": 64}, "k3_c256": {"COLS_W": 256},
                 "k3_c512": {"COLS_W": 512}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="1,2,8")
    ap.add_argument("--ms", default="1,4,16,64")
    ap.add_argument("--cold", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ops", default="oproj,tail", help="of oproj, tail, resnorm (the layer-input op)")
    ap.add_argument("--blocks", type=int, default=3, help="AttnRes blocks of the resnorm op")
    ap.add_argument("--oproj-blocks", type=int, default=0, help="AttnRes blocks of the o-proj op's post-norm")
    ap.add_argument("--variants", default="", help="comma list: only these variants (default: every one)")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from k3compile.kernels import comm, tuning
    from tests import simpeers

    def rel(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()

    t0 = time.time()
    rows = []
    for world in (int(w) for w in a.worlds.split(",")):
        for M in (int(m) for m in a.ms.split(",")):
            for op in a.ops.split(","):
                timers, errs = {}, {}
                base = VARIANTS if world > 1 else {"k3": {}}
                variants = (RESNORM_VARIANTS if op == "resnorm" else {**base, **AR_VARIANTS} if op == "oproj" else base)
                variants = {**variants, **COLS_VARIANTS}
                if a.variants:
                    variants = {n: v for n, v in variants.items() if n in a.variants.split(",")}
                for name, values in variants.items():
                    if op == "resnorm":
                        run, ref, _ = simpeers.residual_norm_case(world, M, a.blocks, seed=M)
                        check = lambda out: max(rel(x, y) for x, y in zip(out, ref))  # noqa: E731
                    elif op == "oproj":
                        run, ref, _ = simpeers.oproj_case(world, M, a.oproj_blocks, seed=M, copies=a.cold)
                        check = lambda out: max(rel(x, y) for x, y in zip(out, ref))  # noqa: E731
                    else:
                        run, ref, _ = simpeers.tail_case(world, M, seed=M, copies=a.cold)
                        check = lambda out: rel(out, ref)  # noqa: E731
                    fn = with_attrs((comm, tuning), run, values)
                    errs[name] = check(fn())
                    timers[name] = GraphTimer(fn)
                    if a.verbose:
                        print(f"  {op} world={world} M={M} {name}: checked and captured", flush=True)
                if op != "resnorm":
                    K, N = (1536, 7168) if op == "oproj" else (3584, 896)
                    xs = torch.randn(M, K, device="cuda").to(torch.bfloat16)
                    ws = [torch.randn(N, K, device="cuda").to(torch.bfloat16) for _ in range(a.cold)]
                    it = iter(range(1 << 62))
                    timers["gemm"] = GraphTimer(lambda: F.linear(xs, ws[next(it) % a.cold]))
                rounds = {n: [t.time() for _ in range(1)] for n, t in timers.items()}
                for _ in range(a.rounds - 1):   # in turn, so that drift falls on every variant alike
                    for n, t in timers.items():
                        rounds[n].append(t.time())
                us = {n: sorted(v)[len(v) // 2] for n, v in rounds.items()}
                rows.append(dict(op=op, world=world, M=M, us=us, us_rounds=rounds, err=errs))
                print(f"{op:<5} world={world} M={M:<3} " + " ".join(f"{n}={v:6.1f}" for n, v in us.items())
                      + f"  max err {max(errs.values()):.1e}", flush=True)
                del timers
                torch.cuda.empty_cache()
    save(a.out, dict(rows=rows, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                     note="one GPU, simulated peers (tests/simpeers.py): no NVLink"), t0)


if __name__ == "__main__":
    main()
