"""Every measured number the kernels dispatch on: M ranges, tuned configs per weight shape and card,
tile sizes, warps and the thresholds between kernel forms.

Each entry names what it decides and where the number came from: a result file under
`bench/results/` (its bench script and card), or BENCHMARKS.md where no file holds it, or "not
measured" with the reason for the value. The code that reads an entry reads it here at each call
(`tuning.NAME`), so a benchmark or a test can set one for a run (AR_PRELOAD alone is read once, with
its knob, into comm.AR_PRELOAD). Experiment knobs (`config.Knobs`) override some of them; the reading
code says which.
"""
from __future__ import annotations

# ------------------------------------------------------------------ communication (kernels/comm.py)

# ONESHOT_M[op] = (lo, hi): the M range of the one-shot symmetric-memory path; outside it the op's NCCL path
# (GEMM + in-place NCCL + the norm kernel; the router: the replicated GEMMs). residual_norm runs the o-proj op's
# kernel without its GEMM: its range is the o-proj op's.
# Measured: bench/results/ops_bench_h200x2.json (bench/ops_bench.py, 2 x H200): one-shot won at every M (1..256)
# for the o-proj and the latent tail, at M <= 16 for the router, at M >= 4 for the plain all-reduce (at M=1 NCCL
# was 3-7% faster).
ONESHOT_M = {"oproj_allreduce_residual": (1, 1 << 30), "moe_latent_tail": (1, 1 << 30),
             "residual_norm": (1, 1 << 30), "router_latent_sharded": (1, 16), "all_reduce_prefetch": (2, 1 << 30)}

# AR_PRELOAD: the all-reduce / norm kernel loads the first four AttnRes block rows together before reducing them
# (triton_comm._ar_pre; the same values, errors 0 against the reference on the H200; K3_KNOBS=ar_preload=0: each
# block row loaded just before it is reduced).
# Measured: bench/results/comm_sim_resnorm_b{3,7}_h200_9a1fa9c.json (one H200, simulated peers): the layer-input
# op with 3 blocks 6.5-6.8 vs 6.7-7.0 us at world 1, M = 1..16; at group size 8 27.2 / 28.9 / 29.2 vs
# 27.1 / 31.0 / 31.0 us (M = 1 / 4 / 16); 7 blocks 0.3-0.5 us faster.
AR_PRELOAD = True

# AR_LEAN_MIN_WORLD: from this group size the all-reduce / norm kernel holds fewer fp32 rows in registers
# (triton_comm.ar_residual_norm_kernel's LEAN: g and the AttnRes query loaded where used, the residual row in the
# model dtype). ptxas (sm_90a, 8 warps, 3 AttnRes blocks): spills per thread at group size 8 3.2 KB -> 0.7 KB,
# at 2 108 -> 56 bytes.
# Measured: bench/comm_sim_bench.py AR_VARIANTS (one H200, simulated peers, 3 blocks; BENCHMARKS.md), us,
# lean / not: group size 8, layer-input op M = 1 / 16: 26.2 / 27.9, 16.4 / 29.3; o-proj op 38.3 / 37.9,
# 25.4 / 44.1; group size 2 and 1 it was 0.2-1.0 us slower (10.5 / 10.1, 7.3 / 6.6 at M=1).
AR_LEAN_MIN_WORLD = 4

# AR_WARPS_M1: the all-reduce / norm kernel's warps at group size >= 8 and one row of 8192 columns, where it
# also takes the joint AttnRes reductions (triton_comm._mix4: the sources four at a time, their sums of squares
# in one reduction and their logits in a second; at group size 1 the updated row among them, _ar_row_w1). The
# joint form runs at group size 1 and there (comm._ar_form).
# Measured: bench/results/comm_sim_ar_w8_h200_a57f020.json (one H200, simulated peers, 3 AttnRes blocks), us,
# layer-input op / o-proj op: joint with 32 warps 15.5 / 23.7 against 22.4 / 31.3 (lean, 16 warps, one by one:
# the form before), 23.3 / 31.2 one by one with 32 warps, 22.5 / 31.2 joint with 16; the same in
# comm_sim_ar_joint_h200_679bc84.json (15.4 / 23.6). Simulated peers: no NVLink trip in these times.
# The joint form, bench/results/comm_sim_ar_joint_h200_679bc84.json, us, joint / one by one: group size 1,
# layer-input op M = 1 / 4 / 16: 5.47 / 6.63, 5.77 / 6.77, 5.81 / 6.76; o-proj op 13.25 / 14.60 at M=1.
# Group size 8 (lean): M=1 22.4 / 22.7, but M = 4 / 16 26.0 / 15.9 and 26.7 / 16.6 (o-proj 38.7 / 24.7 at
# M=4): slower there. (Before the joint form, 16 warps at one row: 22.5 vs 26.2 with 8 for the layer-input op,
# 31.6 vs 38.3 for the o-proj op; at M=16 16 warps were slower, 25.1 vs 16.4.)
AR_WARPS_M1 = 32

# COLS: the column-split forms of the all-reduce / norm and latent-tail kernels (triton_cols) at M <= COLS_MAX_M
# and group size >= COLS_MIN_WORLD: each program takes COLS_W columns of every row and the rows' reductions are
# exchanged once between the programs; COLS_MAX_PROGRAMS keeps the grid barrier's programs all resident.
# Measured: bench/results/comm_sim_cols_h200_f1f0e95.json (`bench/gpu_steps.sh cols`, one H200, simulated
# peers), us, columns / rows at M=1: group size 8: layer-input op 9.9 / 15.6, o-proj op (GEMM included)
# 18.6 / 23.8, latent tail (+ up GEMM) 13.3 / 15.6; group size 1: 6.5 / 5.2, 15.1 / 13.3, 10.4 / 10.6. At M=4
# and at 256 columns per program the AttnRes form took 80-700 us (spills: COLS_MAX_TILE), so: M=1, group
# size >= 2.
COLS, COLS_MIN_WORLD, COLS_MAX_M, COLS_W, COLS_MAX_PROGRAMS = True, 2, 1, 128, 64
# COLS_MAX_TILE: the most elements of the [rows, sources, columns] tile one column-split program holds; beyond it
# (e.g. 5-8 AttnRes sources at 7168 columns, which would need more than COLS_MAX_PROGRAMS programs) the row
# kernels run.
# Measured: bench/results/cols_probe_h200_41ffe02.json (bench/cols_probe.py, the GPU machine's Triton 3.6): the
# AttnRes form at 512 (one row, 4 sources, 128 columns) compiled to 168 registers without spills, at 1024 and
# more to 32 registers and 1.4-5.3 KB of spills per thread, and took 82-707 us (with the grid barrier skipped
# still 16-615 us).
COLS_MAX_TILE = 512

# ------------------------------------------------------------------ decode GEMMs (kernels/gemm.py)

# GEMV_TABLE: the Triton decode GEMMs (kernels/triton_gemv.py) instead of cuBLAS, by weight shape (N, K):
# {M: config name, or None where cuBLAS measured at least as fast}; a call with M takes the entry of the smallest
# measured M >= M (none: cuBLAS). Config names as bench/gemv_bench.py writes them ("mma[s] BN/BK/SPLIT/warps/stages":
# the tensor-core split-K kernel; "gemv BN/BK/warps/stages": the CUDA-core GEMV). An entry where the best config
# was >= 1.03x cuBLAS, None below. These are the per-rank shapes of the layer bench (TP=8 widths on 2 GPUs, and
# TP=2); every other shape runs cuBLAS. Knobs: gemm.gemv_plan.
GEMV_TABLE: dict[tuple[int, int], dict] = {
    # Measured: bench/results/gemv_mma_h200_3aa472c.json (bench/gemv_bench.py, one H200, cold weights, graphed;
    # BENCHMARKS.md); checked again against cuBLAS (other weights, 3 alternating repeats, M = 1 / 2 / 4 / 8 / 16):
    # every entry 1.04-1.53x but (6144, 7168) at M=2, 0.99x.
    (7168, 1536): {1: "mmas 64/256/1/4/3", 4: "mmas 64/256/1/4/3", 16: "mmas 64/256/1/4/3"},  # o-proj, TP=8
    (2240, 7168): {1: "mmas 64/128/4/4/4", 4: "mmas 64/128/4/4/4", 16: "mmas 64/128/4/4/4"},  # router + latent shard
    (3584, 3584): {1: "mmas 64/128/2/4/4", 4: "mmas 64/128/2/4/4", 16: "mmas 64/128/2/4/4"},  # latent up shard
    (7168, 768): {1: "mmas 64/128/1/4/4", 4: "mmas 64/128/1/4/4", 16: "mmas 64/128/1/4/4"},   # shared down, TP=8
    (6284, 7168): {1: "mma 32/256/1/4/4", 4: "mma 32/128/1/4/6", 16: "mma 32/256/1/4/4"},     # KDA in_proj, TP=8
    (3648, 7168): {1: "mma 32/128/2/4/6", 4: "mmas 64/256/2/4/3", 16: "mmas 64/256/2/4/3"},   # MLA qkv_a, TP=8
    (2304, 1536): {1: "gemv 2/1024/4/4", 4: None, 16: None},                                  # MLA q_b, TP=8
    (7168, 6144): {1: "mmas 64/256/1/4/3", 4: "mmas 64/256/1/4/3", 16: "mmas 64/256/1/4/3"},  # o-proj, TP=2
    (6144, 7168): {1: None, 4: "mma 32/256/1/4/4", 16: None},                                 # shared gate-up, TP=2
    (7168, 3072): {1: "mmas 64/256/1/4/3", 4: "mmas 64/256/1/4/3", 16: None},                 # shared down, TP=2
    (24752, 7168): {1: "mma 64/128/1/4/4", 4: "mma 64/128/1/4/4", 16: "mma 64/128/1/4/4"},    # KDA in_proj, TP=2
    (8256, 7168): {1: "mmas 64/256/1/4/3", 4: "mmas 64/256/1/4/3", 16: "mmas 64/128/1/4/4"},  # MLA qkv_a, TP=2
    (9216, 1536): {1: None, 4: None, 16: None},                                               # MLA q_b, TP=2
    # Shared gate-up, TP=8. Measured: bench/results/layer_*_tp8_w1_h200_30bb50b_sharedmma.json (k3 per layer step at
    # world 1). Alone cuBLAS (split-K + a reduce kernel) was as fast at M = 1 / 4, but on the side stream beside the
    # routed path the MMA kernel with 96 programs leaves SMs to the one-program router top-k (which ran 4x slower
    # beside cuBLAS's); us at M = 1 / 4 / 16, cuBLAS -> this: KDA 144.2 / 188.6 / 280.0 -> 133.6 / 178.1 / 278.8,
    # MLA 149.0 / 172.3 / 278.1 -> 140.0 / 167.1 / 277.8 (192 programs, "mma 32/128/4/4/6": 136.6 / 180.4 / 279.7
    # and 143.7 / 168.2 / 275.1).
    (1536, 7168): {1: "mmas 64/128/4/4/4", 4: "mmas 64/128/4/4/4", 16: "mmas 64/128/4/4/4"},
    # TP=1 at TP=8 head widths (layer_bench --world 1): the router, latent down and latent up whole.
    # Measured: bench/results/gemv_w1_h200_331e9a6.json (same rule): 1.09-1.11x, 1.05x at M=1 (1.02x at 4 and 16:
    # None), 1.13 / 1.14 / 1.03x.
    (896, 7168): {1: "mmas 64/128/8/4/4", 4: "mmas 64/128/8/4/4", 16: "mmas 64/128/8/4/4"},   # router, TP=1
    (3584, 7168): {1: "mmas 64/128/4/4/4", 4: None, 16: None},                                # latent down, TP=1
    (7168, 3584): {1: "mmas 64/256/1/4/3", 4: "mmas 64/256/1/4/3", 16: "mmas 64/256/1/4/3"},  # latent up, TP=1
    # The router and latent down stacked (gemm.mma_gemm2, shard_router_latent at TP=1).
    # Measured: bench/results/gemv_w1_stacked_h200_5f8936e.json: 19.2 / 19.4 / 19.5 us at M = 1 / 4 / 16 (cuBLAS
    # 20.3 / 20.2 / 21.1), where the two alone took 7.4 + 16.2 us.
    (4480, 7168): {1: "mmas 64/128/2/4/4", 4: "mmas 64/128/2/4/4", 16: "mmas 64/128/2/4/4"},
}

# GEMV_TABLE_BY_CARD: per-card rows over GEMV_TABLE (which was tuned on the H200), merged per M: the rows of the
# first key that is a substring of the GPU's name (knobs: gemm.card_rows).
GEMV_TABLE_BY_CARD: dict[str, dict[tuple[int, int], dict]] = {
    # H100: the in_proj GEMMs, the stacked router + latent down and the MLA q_b at M=1 on the CUDA-core GEMV, LAZY.
    # Measured: bench/results/gemv_tune_h100_b8043ff.json (H100 sweep); in the layer
    # bench/results/layer_{kda,mla}_tp8_w1_h100_8321eed_gemvrows.json, us per step launch hidden: KDA 142.1 -> 140.1,
    # MLA 143.4 -> 141.5 (the same configs on an H200: KDA 114.9 -> 117.9, MLA 120.1 -> 120.7, hence not in
    # GEMV_TABLE). At M = 4 the H100 sweep's table changed nothing (177.6 / 188.0 -> 177.6 / 188.3), so only M=1
    # rows. In place, on another H100 (..._h100_680df18_card.json): KDA 139.8 -> 138.9, MLA 140.9 -> 139.8.
    # The stacked router + latent down (4480 x 7168, TP=1; gemm.mma_gemm2 with the GEMV's TWO form) at M=1, forced
    # in the layer on an H100 (..._h100_f5fc5d7_rlgemv.json): KDA 138.5 -> 137.0, MLA 140.0 -> 138.8
    # ("gemv 8/512/4/3": 140.7 / 143.8). The shared gate-up on the GEMV there was slower (139.7 / 141.4): beside
    # the routed kernels it wants the MMA kernel's programs.
    # The LAZY form (one K sum after the loop, "gemvl"): bench/results/gemv_lazy_h100_5fec68c.json, swept alone at
    # M=1 on an H100, 0.3-0.6 us less than the plain picks on these four shapes; in the layer
    # (..._h100_a8800d9_lazyx.json, 5 rounds) all four at once: KDA 140.0 -> 139.0, MLA 140.9 -> 139.5 (the
    # stacked one alone: 139.1 / 140.2).
    "H100": {(6284, 7168): {1: "gemvl 8/512/4/3"},     # KDA in_proj, TP=8
             (3648, 7168): {1: "gemvl 4/1024/4/3"},    # MLA qkv_a, TP=8
             (4480, 7168): {1: "gemvl 2/1024/4/4"},    # router + latent down stacked, TP=1
             (2304, 1536): {1: "gemvl 2/1024/4/4"}},   # MLA q_b, TP=8
}

# GEMV_DEFAULT: (BLOCK_N, BLOCK_K, num_warps, num_stages) of the CUDA-core GEMV where no tuned config is given
# (K3_KNOBS=gemv=1 on a shape without an entry); a fifth element 1 asks for the LAZY form ("gemvl" names).
# Not measured as a default: GEMV_TABLE holds the measured configs.
GEMV_DEFAULT = (8, 512, 4, 3)

# GEMV_PDL_PF: bytes of each program's weight rows the CUDA-core GEMV requests into L2 before its PDL wait, by
# weight shape, where the GEMV reads the output of the one-program TP=1 all-reduce / norm kernel (which lets it
# launch at its start: TRIGGER). GEMV_PDL_DEFAULT: the pair on with K3_KNOBS gemv_pdl unset.
# Measured: bench/results/pdl_probe_h200_51d35a4.json (bench/pdl_probe.py, one H200), norm + GEMV pair, us,
# no PDL / PDL alone / 8 / 16 / 32 / 64 KiB: MLA qkv_a (gemvl 4/1024/4/3) 19.82 / 19.86 / 17.15 / 17.11 / 18.39 /
# 21.15; KDA in_proj (gemvl 8/512/4/3) 28.47 / 28.44 / 25.70 / 25.52 / 26.67 / 29.22; the stacked router + latent
# (gemvl 2/1024/4/4, 2240 programs) 24.00 / 23.86 / 24.99 / 25.20 / 26.93 / 26.41. PDL with no prefetch gains
# nothing, and a GEMV launched with PDL after a kernel that does not trigger (the MLA q_b after Inductor's norm)
# took 5.44 us against 4.77 in the layer: only the pair gets it.
# Measured: bench/results/pdl_probe_h100_f41d0ef.json (one H100, the same probe), us, no PDL / 8 / 16 / 32 /
# 64 KiB: qkv_a 24.77 / 20.06 / 19.83 / 21.59 / 24.23, in_proj 37.19 / 32.94 / 32.62 / 33.74 / 34.86, router +
# latent 28.74 / 27.06 / 28.27 / 30.40 / 29.64 (the H200 runs these three on the MMA GEMM, where no PDL applies).
# Measured: bench/results/layer_{kda,mla}_tp8_w1_h100_f41d0ef_pdl.json (the layers at M=1, us with the launch
# hidden), no PDL / qkv_a and in_proj at 16 KiB: KDA 138.8 / 135.2, MLA 139.4 / 135.1, every round of the second
# below every round of the first. With the router + latent at 8 KiB too (layer_*_h100_843c313_pdl1.json; no PDL /
# without that entry / this table): KDA 139.0 / 135.2 / 132.4, MLA 139.4 / 134.9 / 132.5; M = 4 and 16 (MMA
# GEMMs there) unchanged within 0.4 us.
GEMV_PDL_PF = {(3648, 7168): 16384, (6284, 7168): 16384, (4480, 7168): 8192}
GEMV_PDL_DEFAULT = True

# ------------------------------------------------------------------ MoE (kernels/moe.py)

# ROUTER_SORT: the router top-k's selection by Triton's bitonic top-k (tl.topk over the packed keys, one pass,
# 8 warps) instead of k max-reduction rounds (4 warps); K3_KNOBS=router_sort=0/1 overrides.
# Measured: bench/results/router_topk_h200_82d2ce6.json (bench/router_bench.py, one H200, E = 896, top-16), us at
# M = 1 / 4 / 16: rounds 4 warps 5.24 / 5.24 / 5.27; bitonic 4 warps 4.75 / 4.77 / 4.79, 8 warps
# 3.79 / 3.84 / 3.86, 16 warps 4.09 / 4.09 / 4.13. (E > 1024 not measured; those take 16 warps bitonic, 8 by
# rounds.)
ROUTER_SORT = True

# CUTE_M[op] = (lo, hi): the M range where the CuTe kernel measured faster on the GPU (kernels/cute/artifacts.py).
# mxfp4_experts: the CuTe f16x2 GEMVs (cute_h2) against the Triton kernels, cold routings, one H200.
# Measured: bench/results/experts_x_cold8_h200_6e8cc72.json (BENCHMARKS.md "MXFP4 routed experts"), with v4g's
# bf16x2 scale (TP=8 / TP=2 shapes, cute_h2 / v4g us) M=64: 551 / 620, 2220 / 2232; M=80: 683 / 687,
# 2795 / 2473; M=96: 811 / 754, 3308 / 2696 (before that form: up to 96). Below: 1.14-1.38x Triton v3 at every
# measured M (TP=8 M=1/4/16/64, TP=2 M=1/16). With skewed routing v3g was faster from M=16 on, but dispatch cannot
# see the routing.
# oproj (the skinny GEMM) has no range: it measured equal to cuBLAS at best (BENCHMARKS.md). oproj_push (the
# skinny GEMM with the push all-reduce epilogue, comm.push_gemm) has none: on 2 x H200 (cold weights, 3 AttnRes
# blocks) the op was within 0.5 us of the pull path at TP=8 shapes M = 1..64 (22.1 vs 22.6 us at M=1), and the
# KDA / MLA layers with it within their rounds' spread (+2.1 / +2.4 us at M=1) (BENCHMARKS.md).
CUTE_M: dict[str, tuple[int, int]] = {"mxfp4_experts": (1, 79)}

# CUTE_PDL: the CuTe MXFP4 down kernel launched with Programmatic Dependent Launch (it starts while gate-up
# drains), at every batch; K3_KNOBS=cute_pdl=0 turns it off.
# Measured: `experts_bench.py --cold 8` (a different routing each call, one H200, each case 4 times in alternating
# order; BENCHMARKS.md): TP=8 shapes (I=384) M = 1/2/4/8 -0.2/-1.5/-1.9/-2.0 us with it, TP=2 shapes (I=1536)
# -1.7/-1.4/0.0/-6.7 us. (With the same routing every call, M=1 at TP=8 had been 0.9-1.3 us slower with it: its
# 35 MB of experts stayed in the L2 between calls.)
CUTE_PDL = True

# CUTE_XF_MAX_N: the CuTe f16x2 gate-up with its activation loads before the first cp.async wait ("xf") up to
# this many tokens.
# Measured: bench/results/experts_alt_cold8_h200_bab4aec.json (cold routings, one H200): 1.0-1.8 us faster at
# 1 token, 0.1-0.6 us at 2, mixed at 4, slower at 8-16.
CUTE_XF_MAX_N = 2
# CUTE_MXFP4_LDG: the register-staged kernels ("ldgd", build.MXFP4_TAGS) up to this many tokens, by per-rank
# expert width I.
# Measured: bench/results/experts_alt_cold8_h200_* (cold routings, one H200, alternating repeats in one run): with
# 8 + 8 gate-up rows per CTA against the kernels dispatch took before (xf up to 2 tokens, untagged above), TP=8
# (I=384) M = 1/2/4/8/16: 1.16 / 1.12-1.13 / 1.11 / 1.04-1.07 / 1.07-1.12x; the 16 + 16 rows now built against
# those 8 + 8: TP=8 1.01-1.04x at M <= 16, and against the old kernels at TP=2 (I=1536) M = 2/4/8/16: 1.03 /
# 1.05-1.08 / 1.05-1.11 / 1.04-1.08x (M=1: 1.02-1.03x over the 8 + 8 rows, which were 1.03-1.05x over xf). Not run
# above 16.
CUTE_MXFP4_LDG = {384: 16, 1536: 16}

# MXFP4_GROUPED_MIN_N .. MXFP4_GROUPED_MAX_N: the tokens where the default Triton expert kernel is v4g (pairs
# grouped by expert), below v3; not run above M=256, so v3 stays the default there.
# Measured: cold routings, one H200, TP=8 / TP=2 shapes (BENCHMARKS.md): v4g (BL=128) vs v3g 1.22-1.20x at M=16,
# 1.25-1.23x at 64, 1.48-1.39x at 256; MUL2 (the scales by bf16x2 multiplies,
# bench/results/experts_v4g_mul2_cold8_h200_3fae985.json) 1.20-1.23x more at M = 64, 256. (v3g vs v3 before:
# 0.94-0.95x at M=64, 1.14-1.88x at M = 96..192, 2.2-2.3x at M=256.)
MXFP4_GROUPED_MIN_N, MXFP4_GROUPED_MAX_N = 65, 256

# MXFP4_TUNED[variant]: tiles by batch (tokens N <= bound); shapes these tiles do not fit use the variant's
# defaults (moe._mxfp4_tiles).
# Measured: the tile sweeps on the H200 (TP=8 shapes; BENCHMARKS.md). v2b: at M=1 num_warps=8 was best, 35.6 us
# vs 43.9 us; at M=16 the pipelined loop with 32 rows, 378 us vs 519 us. v3: its defaults at M=1 (22.8 us; the
# best of 9 tiles, BL=64, was 22.1 us, within noise); at M=16 k steps of 128 bytes in gate-up, 231.3 us vs
# 246.5 us.
MXFP4_TUNED = {"v2b": ((4, {"num_warps": 8}), (1 << 30, {"LOOP": 1, "num_stages": 3, "BI": 32})),
               "v3": ((4, {}), (1 << 30, {"BKB_GU": 128}))}

# ------------------------------------------------------------------ attention (kernels/attention.py)

# MLA decode: heads per program, cache rows per tile, programs aimed at, fewest cache rows per split, warps. A
# split's fp32 partial (H x L) costs as much to write and combine as 2 x H / (L + R) of its rows cost to read (at
# 12 heads and a 1025-row context, splits of 32 rows write 0.8 MB of partials for 1.2 MB of cache), yet more
# programs win at decode.
# Measured: bench/results/mla_sweep_h200_917d221.json (bench/mla_bench.py, one H200, 12 heads, context 1024), us at
# M = 1 / 4 / 16, fewest rows 32 / 64 / 128 (4 warps): 10.0 / 11.0 / 14.3, 10.6 / 11.4 / 15.1, 24.4 / 24.4 / 24.1
# (the op's PyTorch reference 61.2, 80.8, 184.2); 8 warps no better; tiles of 64 rows do not fit in shared memory.
MLA_BH, MLA_BS, MLA_PROGRAMS, MLA_MIN_CH, MLA_WARPS = 16, 32, 132, 32, 4
# MLA_COMBINE_BL: columns of the latent per combine program where the (token, head) rows alone give fewer programs
# than MLA_PROGRAMS (a TP=8 rank at M=1 has 12 heads: 12 programs, each reading every split's [L] partial); 0: one
# program per row. K3_KNOBS mla_combine_bl overrides at every M (0: never split).
# Measured: bench/results/layer_mla_tp8_w1_h200_5854264_mlaout.json (MLA layer at TP=8 widths, one H200, replay
# timeline), combine kernel us at M = 1 / 4 / 16 with 0 / 64 / 128 columns: 4.16 / 3.10 / 4.61,
# 4.42 / 4.19 / 5.50, 1.98 / 4.06 / 3.68 (M=16 has 192 rows: split there it is slower).
MLA_COMBINE_BL = 64
# MLA_UV_BV: value columns per program of the MLA combine + value up-projection kernel (K3_KNOBS mla_uv_bv
# overrides).
# Measured: bench/results/layer_mla_tp8_w1_h200_ad84e26_fold.json (MLA layer at TP=8 widths, one H200), 16 vs 32
# columns, us at M = 1 / 4 / 16: 122.8 / 162.7 / 268.8 vs 122.0 / 161.0 / 270.1: within noise.
MLA_UV_BV = 16
# MLA_UV_FLAT: the combine + value up-projection with the split count a constant (triton_mla._combine_splits_flat;
# warps MLA_UV_WARPS), FLAT up to MLA_UV_FLAT_MAX_M tokens. K3_KNOBS mla_uv_flat (at every M) / mla_uv_warps
# override.
# Measured: bench/results/layer_mla_tp8_w1_h200_a867659_pipe.json (MLA layer at TP=8 widths, one H200), us at
# M = 1 / 4 / 16: default 125.9 / 158.8 / 267.0, FLAT 123.6 / 159.0 / 267.9 (combine kernel 5.15 -> 4.29 us at M=1).
MLA_UV_FLAT, MLA_UV_FLAT_MAX_M, MLA_UV_WARPS = True, 1, 4

# CONV_BLOCK: channels per program of the KDA short conv (K3_KNOBS conv_block overrides; a power of two >= 32);
# 1024 gave a TP=8 rank's 4608 channels 5 programs at M=1, 256 gives 18.
# Measured: bench/results/layer_kda_tp8_w1_h200_*_{onegemm,tl}.json (KDA layer at TP=8 widths, one H200), k3 with
# 1024 / 256 / 128, us at M=1: 139.5 / 137.1 / 138.2 and 141.6 / 138.7 / 138.7 in two runs; M=4, 16 within 1 us.
CONV_BLOCK = 256
# KDA_FB_BV: value columns per program of triton_kda (K3_KNOBS kda_fb_bv overrides).
# Not measured: fla-core's fused_recurrent_kda uses 32 too.
KDA_FB_BV = 32
# KDA_STEP_P: programs per (token, head) of the KDA step kernel (value blocks of KDA_FB_BV split over them; the
# q / k conv shift by the last to arrive: triton_kda's docstring); 1 where no counters are to be had (K3_KNOBS
# kda_step_p overrides).
# Not measured alone: 4 programs per head of K = V = 128 (one per value block of 32 columns).
KDA_STEP_P = 4
