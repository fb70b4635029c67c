"""Compile the Triton kernels for sm_90 on a machine without a GPU (catches compile errors that
the CPU interpreter does not see, and lets tests inspect the PTX).

    python -m bench.aot_check [--quick]   (from the repository root)
"""
from __future__ import annotations

import inspect

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from k3compile.kernels import triton_comm as K
from k3compile.kernels import triton_cols as KL
from k3compile.kernels import triton_moe as KM
from k3compile.kernels import triton_gemv as KG
from k3compile.kernels import triton_router as KR
from k3compile.kernels import triton_conv as KC
from k3compile.kernels import triton_kda as KK
from k3compile.kernels import triton_mla as KA

TARGET = GPUTarget("cuda", 90, 32)


def _sig(fn, types: dict, consts: dict) -> tuple[dict, dict]:
    """(signature, constexprs): a constexpr parameter not given in `consts` takes its default."""
    sig = {}
    consts = dict(consts)
    for name, prm in inspect.signature(fn.fn).parameters.items():
        if name not in consts and prm.default is not inspect.Parameter.empty:
            consts[name] = prm.default
        if name in consts:
            sig[name] = "constexpr"
        else:
            sig[name] = types.get(name, "*bf16")
    return sig, consts


def compile_one(fn, types: dict, consts: dict, aligned: bool = False):
    """aligned: mark every pointer and integer argument divisible by 16, as Triton's JIT does at
    run time for such values (16-byte aligned tensors, I and L); without it loads are not
    vectorised and the PTX misrepresents the memory path."""
    sig, consts = _sig(fn, types, consts)
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values())
             if aligned and (t.startswith("*") or t in ("i32", "i64"))}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=TARGET)


def variants():
    """(name, kernel, scalar types, constexprs) for every shape family the ops launch."""
    ints = {"ptrs": "*i64", "pads": "*i64", "epoch": "*i32", "HALF": "i64", "M": "i32", "N": "i32",
            "eps": "fp32", "S": "i32", "E": "i32", "L": "i32", "SP": "i32", "w": "*fp32", "nbytes": "i64",
            "base": "*u8", "FLAG_OFF": "i64", "NT": "i32"}
    out = []
    for world in (1, 2, 8):
        for nb in (0, 3):
            for has_res, has_norm in ((1, 1), (0, 0), (0, 1)):
                out.append((f"ar_residual_norm w{world} nb{nb} res{has_res} norm{has_norm}", K.ar_residual_norm_kernel,
                            ints, dict(RANK=0, WORLD=world, NB=nb, HAS_NORM=has_norm, HAS_RES=has_res,
                                       BLOCK_N=8192, DTYPE=tl.bfloat16, SEQ=1)))
        if world == 1:   # K3_KNOBS gemv_pdl: the layer-input op at TP=1 letting the GEMV after it launch at once
            out.append(("trigger ar_residual_norm w1 nb3", K.ar_residual_norm_kernel, ints,
                        dict(RANK=0, WORLD=1, NB=3, HAS_NORM=1, HAS_RES=1, BLOCK_N=8192, DTYPE=tl.bfloat16, SEQ=1,
                             TRIGGER=1)))
        out.append((f"latent_tail w{world}", K.latent_tail_kernel, ints,
                    dict(TOPK=16, RANK=0, WORLD=world, BLOCK_N=4096, BLOCK_SP=8192, DTYPE=tl.bfloat16, SEQ=1)))
        if world > 1:
            out.append((f"gather w{world}", K.gather_router_latent_kernel, ints,
                        dict(RANK=1, WORLD=world, BLOCK=1024, DTYPE=tl.bfloat16, SEQ=1)))
    # the column-split forms (triton_cols): M <= 4 rows, W columns per program, one grid barrier
    for world in (1, 8):
        for nb, rows, w, s_pad in ((3, 1, 128, 4), (0, 4, 128, 2), (7, 4, 64, 8)):
            out.append((f"cols ar_norm w{world} nb{nb} rows{rows}", KL.ar_norm_cols_kernel, {**ints, "bar": "*i32",
                        "slots": "*fp32"}, dict(RANK=0, WORLD=world, NB=nb, HAS_RES=1, ROWS=rows, W=w, S_PAD=s_pad,
                                                P_PAD=64, DTYPE=tl.bfloat16, SEQ=1, VEC=1, PHASE=0)))
        out.append((f"cols latent_tail w{world}", KL.latent_tail_cols_kernel, {**ints, "bar": "*i32", "slots": "*fp32"},
                    dict(TOPK=16, RANK=0, WORLD=world, ROWS=1, W=128, WSP=256, P_PAD=32, DTYPE=tl.bfloat16, SEQ=1,
                         VEC=1, PHASE=0)))
    # after the CuTe push GEMM: waits on its flags, reads only this rank's buffer (no barrier signal)
    for world in (2, 8):
        out.append((f"pushed ar_residual_norm w{world}", K.ar_residual_norm_kernel, ints,
                    dict(RANK=1, WORLD=world, NB=3, HAS_NORM=1, HAS_RES=1, BLOCK_N=8192, DTYPE=tl.bfloat16, SEQ=1,
                         PUSHED=1)))
    # the peers signalled and polled one after another (comm.COMM_VEC=0)
    out.append(("loop ar_residual_norm w8", K.ar_residual_norm_kernel, ints,
                dict(RANK=0, WORLD=8, NB=0, HAS_NORM=1, HAS_RES=1, BLOCK_N=8192, DTYPE=tl.bfloat16, SEQ=1, VEC=0)))
    # seven blocks (four loaded together, comm.AR_PRELOAD), and each block row loaded just before its
    # reduction (K3_KNOBS=ar_preload=0)
    for nb, pre in ((7, 1), (3, 0), (8, 1)):
        out.append((f"preload{pre} ar_residual_norm w8 nb{nb}", K.ar_residual_norm_kernel, ints,
                    dict(RANK=0, WORLD=8, NB=nb, HAS_NORM=1, HAS_RES=1, BLOCK_N=8192, DTYPE=tl.bfloat16, SEQ=1,
                         PRELOAD=pre)))
    # the AttnRes sources one after another (K3_KNOBS=ar_joint=0), at group sizes 1 and 8
    for world in (1, 8):
        out.append((f"seq ar_residual_norm w{world} nb3", K.ar_residual_norm_kernel, ints,
                    dict(RANK=0, WORLD=world, NB=3, HAS_NORM=1, HAS_RES=1, BLOCK_N=8192, DTYPE=tl.bfloat16, SEQ=1,
                         JOINT=0)))
    # the CAS-handshake barrier (K3_KNOBS=barrier_seq=0)
    out.append(("cas ar_residual_norm w2", K.ar_residual_norm_kernel, ints,
                dict(RANK=0, WORLD=2, NB=3, HAS_NORM=1, HAS_RES=1, BLOCK_N=8192, DTYPE=tl.bfloat16, SEQ=0)))
    out.append(("l2_prefetch", K.l2_prefetch_kernel, ints, dict(LANES=128)))
    out.append(("situ", KM.situ_kernel, dict(ints, gu="*bf16", out="*bf16", I="i32", beta="fp32", lbeta="fp32"),
                dict(BLOCK=1024)))
    out.append(("router_topk E896", KR.router_topk_kernel, dict(ints, logits="*bf16", bias="*fp32", ids="*i64",
                                                                 scale="fp32"), dict(K=16, KP=16, BLOCK=1024)))
    out.append(("router_topk E896 int32 ids", KR.router_topk_kernel, dict(ints, logits="*bf16", bias="*fp32",
                                                                          ids="*i32", scale="fp32"),
                dict(K=16, KP=16, BLOCK=1024)))   # what fuse_router_topk emits before the expert ops
    gv = dict(ints, x="*bf16", w="*bf16", out="*bf16", K="i32", sxm="i32", swn="i32", som="i32")
    for mp, bn, bk in ((1, 8, 512), (4, 4, 1024), (8, 16, 256)):  # M = 1 / 4 / 8 tiles of the sweep
        out.append((f"gemv MP{mp} BN{bn} BK{bk}", KG.gemv_kernel, gv,
                    dict(MP=mp, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=1, ACC=0)))
    out.append(("gemv acc ragged", KG.gemv_kernel, gv, dict(MP=1, BLOCK_N=8, BLOCK_K=512, EVEN_K=0, ACC=1)))
    # the LAZY form (one sum after the loop) at M=1 and M=2 ("gemvl" configs)
    out.append(("gemv lazy", KG.gemv_kernel, gv, dict(MP=1, BLOCK_N=4, BLOCK_K=1024, EVEN_K=1, ACC=0, LAZY=1)))
    out.append(("gemv lazy MP2 ragged", KG.gemv_kernel, gv, dict(MP=2, BLOCK_N=8, BLOCK_K=512, EVEN_K=0, ACC=0, LAZY=1)))
    out.append(("gemv pdl", KG.gemv_kernel, gv, dict(MP=1, BLOCK_N=8, BLOCK_K=512, EVEN_K=1, ACC=0, PDL=1, GDC=1)))
    # K3_KNOBS gemv_pdl: the lazy and stacked (TWO) forms with the weight slice's L2 prefetch before the wait
    out.append(("gemv pdl pf lazy", KG.gemv_kernel, gv, dict(MP=1, BLOCK_N=4, BLOCK_K=1024, EVEN_K=1, ACC=0, PDL=1,
                                                             GDC=1, LAZY=1, PF=16384, LANES=128)))
    out.append(("gemv pdl pf two", KG.gemv_kernel, dict(gv, N1="i32", swn2="i32", som2="i32"), dict(MP=1, BLOCK_N=4, BLOCK_K=1024, EVEN_K=1, ACC=0, PDL=1,
                                                            GDC=1, LAZY=1, TWO=1, PF=65536, LANES=128)))
    mg = dict(gv, part="*fp32", cnt="*i32", w2="*bf16", out2="*bf16", N1="i32", swn2="i32", som2="i32")
    for sw, bn in ((0, 32), (1, 64)):
        for sp in (1, 4):
            out.append((f"mma_gemm{' swap' if sw else ''} split{sp}", KG.mma_gemm_kernel, mg,
                        dict(BM=16, BN=bn, BK=256, SPLIT=sp, SWAP=sw, EVEN_K=1, ACC=0)))
    # two weights in one launch (the router + latent down-projection at TP=1: gemm.mma_gemm2)
    out.append(("mma_gemm two swap split4", KG.mma_gemm_kernel, mg,
                dict(BM=16, BN=64, BK=128, SPLIT=4, SWAP=1, EVEN_K=1, ACC=0, TWO=1)))
    mla = dict(ints, q_lat="*bf16", q_rope="*bf16", cache="*bf16", lens="*i64", part_o="*fp32", part_ml="*fp32",
               out="*bf16", H="i32", CH="i32", NS="i32", scale="fp32", sqm="i32", sqh="i32", srm="i32", srh="i32",
               scm="i32", scs="i32", som="i32", soh="i32", snm="i32", kv_w="*bf16", eps="fp32")
    out.append(("mla_split L512", KA.mla_split_kernel, mla, dict(L=512, R=64, BH=16, BS=32, IEEE=0)))
    # with the kv_a RMSNorm in the kernel (fold_mla_prologue's k3::mla_decode_normed)
    out.append(("mla_split L512 norm", KA.mla_split_kernel, mla, dict(L=512, R=64, BH=16, BS=32, IEEE=0, NORM=1)))
    out.append(("kda_conv_decode", KC.kda_conv_decode_kernel,
                dict(ints, CQ="i32", sxq="i32", sxk="i32", sxv="i32", ssm="i32", ssc="i32", sst="i32", snm="i32",
                     snc="i32", snt="i32"),
                dict(KW=4, BLOCK=1024)))
    # the KDA step with the gate's f_b GEMV (fold_kda_fb's k3::kda_decode_fb) at a TP=8 rank's widths
    out.append(("kda_decode_fb", KK.kda_decode_fb_kernel,
                dict(ints, a_log="*fp32", dt_bias="*fp32", state="*fp32", H="i32", sq="i32", sk="i32", sv="i32",
                     sfa="i32", sb="i32", lower="fp32", scale="fp32"),
                dict(K=128, V=128, R=128, BV=32, BR=32, QK_DT=tl.bfloat16, F_DT=tl.bfloat16)))
    # the whole KDA step (fold_kda_step's k3::kda_step_decode_): 4 programs per head (the arrival counter) or 1
    # (+ norm: with fold_kda_onorm's output norm, done by the head's last program)
    for p in (4, 1):
        for norm in (0, 1):
            out.append((f"kda_step_decode p{p}{' norm' if norm else ''}", KK.kda_step_decode_kernel,
                        dict(ints, xq="*bf16", xk="*bf16", xv="*bf16", cstate="*bf16", cw="*bf16", a_log="*fp32",
                             dt_bias="*fp32", state="*fp32", cnt="*i32", H="i32", sxq="i32", sxk="i32", sxv="i32",
                             scm="i32", scc="i32", sct="i32", sfa="i32", sb="i32", lower="fp32", scale="fp32",
                             w_o="*bf16", gate="*bf16", sg="i32", o_eps="fp32"),
                        dict(K=128, V=128, R=128, BV=32, P=p, BR=32, QK_DT=tl.bfloat16, F_DT=tl.bfloat16, NORM=norm)))
    out.append(("mla_combine L512", KA.mla_combine_kernel, mla, dict(L=512, BNS=16)))
    # the combine + value up-projection (fold_mla_output's k3::mla_decode_uv)
    out.append(("mla_combine_uv L512", KA.mla_combine_uv_kernel,
                dict(mla, w="*bf16", gate="*bf16", V="i32", swh="i32", swl="i32", swv="i32", sgm="i32", sgh="i32",
                     sgv="i32"), dict(L=512, BNS=8, BV=16, GATE=1)))
    out.append(("mla_combine_uv L512 flat", KA.mla_combine_uv_kernel,
                dict(mla, w="*bf16", gate="*bf16", V="i32", swh="i32", swl="i32", swv="i32", sgm="i32", sgh="i32",
                     sgv="i32"), dict(L=512, BNS=8, BV=16, GATE=1, NSC=33, NSP=64)))
    moe = dict(ints, x="*bf16", ids="*i32", w13="*u8", s13="*u8", w2="*u8", s2="*u8", mid="*fp32", I="i32",
               beta="fp32", lbeta="fp32", out="*bf16", L="i32")
    out.append(("mxfp4_gate_up", KM.mxfp4_gate_up_kernel, moe, dict(K=16, L=3584, BI=16, BKB=128)))
    out.append(("mxfp4_down", KM.mxfp4_down_kernel, moe, dict(I=384, BL=32, BKB=64)))
    for I in (384, 1536):  # TP=8, TP=2
        out.append((f"mxfp4_dot_gate_up I{I}", KM.mxfp4_gate_up_dot_kernel, moe,
                    dict(K=16, L=3584, BN=64, BKB=64, BT=16, LOOP=0)))
        out.append((f"mxfp4_dot_down I{I}", KM.mxfp4_down_dot_kernel, moe, dict(I=I, BN=64, BKB=64, BT=16, LOOP=0)))
        out.append((f"mxfp4_v2b_gate_up I{I}", KM.mxfp4_gate_up_v2b_kernel, moe, dict(K=16, L=3584, BI=16, BKB=256, LOOP=0)))
        out.append((f"mxfp4_v2b_down I{I}", KM.mxfp4_down_v2b_kernel, moe, dict(I=I, BL=32, BKB=64, LOOP=0)))
        # v3: moe._mxfp4_tiles' defaults (num_stages: Triton's default here, 3 at launch)
        out.append((f"mxfp4_v3_gate_up I{I}", KM.mxfp4_gate_up_v3_kernel, moe,
                    dict(K=16, L=3584, BI=32, BKB=256, BT=16, FP16=0, DOT_F32=0)))
        out.append((f"mxfp4_v3_down I{I}", KM.mxfp4_down_v3_kernel, moe,
                    dict(I=I, BL=128, BKB=64, BT=16, FP16=0, DOT_F32=0)))
    # the pipelined k loop (LOOP=1; num_stages comes from the launch, Triton's default here)
    out.append(("mxfp4_dot_gate_up loop", KM.mxfp4_gate_up_dot_kernel, moe, dict(K=16, L=3584, BN=64, BKB=64, BT=16,
                                                                                  LOOP=1)))
    out.append(("mxfp4_v3_gate_up BI64", KM.mxfp4_gate_up_v3_kernel, moe,
                dict(K=16, L=3584, BI=64, BKB=128, BT=16, FP16=0, DOT_F32=0)))
    out.append(("mxfp4_v3_gate_up fp16", KM.mxfp4_gate_up_v3_kernel, moe,
                dict(K=16, L=3584, BI=32, BKB=256, BT=16, FP16=1, DOT_F32=0)))
    out.append(("mxfp4_v2b_gate_up loop", KM.mxfp4_gate_up_v2b_kernel, moe, dict(K=16, L=3584, BI=16, BKB=128,
                                                                                  LOOP=1)))
    # the pairs grouped by expert: v3g (block-diagonal activation columns) and v4g (scaled A tile)
    grp = dict(moe, order="*i32", sorted_e="*i32", tstart="*i32", P="i32", ws="*i32")
    out.append(("mxfp4_group_count", KM.mxfp4_group_count_kernel, grp, dict(PB=4096, EB=1024, TG=16)))
    for v, (bkb_gu, bkb_d, tg) in (("v3g", (64, 64, 8)), ("v4g", (128, 64, 16))):   # V4=1 for v4g
        t = dict(grp, mid="*bf16") if v == "v4g" else grp     # v4g's mid: down's bf16 B operand
        out.append((f"mxfp4_{v}_gate_up", KM.mxfp4_gate_up_v3g_kernel, t,
                    dict(K=16, L=3584, BI=32, BKB=bkb_gu, TG=tg, FP16=0, DOT_F32=0, V4=int(v == "v4g"))))
        out.append((f"mxfp4_{v}_down", KM.mxfp4_down_v3g_kernel, t,
                    dict(I=384, BL=64, BKB=bkb_d, TG=tg, FP16=0, DOT_F32=0, V4=int(v == "v4g"))))
    out.append(("mxfp4_v4g2_gate_up", KM.mxfp4_gate_up_v3g_kernel, dict(grp, mid="*bf16"),
                dict(K=16, L=3584, BI=32, BKB=128, TG=16, FP16=0, DOT_F32=0, V4=2)))
    out.append(("mxfp4_v4g_operand", KM.v4g_operand_kernel, moe, dict(BLOCK=1024)))
    return out


# PTX each kernel family must contain: the barrier's system-scope CAS, the bulk L2 prefetch
SEQ_PTX = ["sys.release.exch", "sys.acquire"]  # posted system-scope signal, acquiring spin (ld or atom)
EXPECT = {"mla_split": ["mma"],   # the scores and p @ c on the tensor cores
          "ar_residual_norm w2": SEQ_PTX, "latent_tail w2": SEQ_PTX, "gather w2": SEQ_PTX,
          "cas ar_residual_norm w2": ["atom.global.release.sys.cas", "atom.global.acquire.sys.cas"],
          "l2_prefetch": ["cp.async.bulk.prefetch.L2.global"],
          "mxfp4_dot": ["mma"],  # dot_scaled must reach the tensor cores (mma.sync or wgmma)
          "mxfp4_v3": ["mma"],   # v3's bf16 / fp16 tl.dot too
          "mxfp4_v4g_gate_up": ["wgmma", "cp.async"], "mxfp4_v4g2_gate_up": ["wgmma", "mul.rn.bf16x2"], "mxfp4_v4g_down": ["wgmma", "cp.async"],
          # the counts and slots by atomics, read back from L2 (.cg: not a stale L1 line)
          "mxfp4_group_count": ["atom.global.cta.relaxed.add", "ld.global.cg"],
          "gemv pdl": ["griddepcontrol.wait", "griddepcontrol.launch_dependents"],
          "gemv pdl pf": ["cp.async.bulk.prefetch.L2.global"],
          "trigger ar_residual_norm": ["griddepcontrol.launch_dependents"],
          "trigger latent_tail": ["griddepcontrol.launch_dependents"],
          "mma_gemm pdl pf": ["cp.async.bulk.prefetch.L2.global", "griddepcontrol.wait"],
          # the arrival counter: a gpu-scope acq_rel atomic, put back to zero by the last program
          "kda_step_decode p4": ["atom.global.gpu.acq_rel.add", "atom.global.gpu.relaxed.exch"],
          # with the output norm the last program reads the head's outputs back from L2 (.cg)
          "kda_step_decode p4 norm": ["ld.global.cg"], "kda_step_decode p1 norm": ["ld.global.cg"],
          # the tensor cores (mma.sync with the tokens as M, wgmma with the weight rows as M), the
          # weights through cp.async; a split counts in with a gpu-scope acq_rel atomic and the last
          # program reads the partials from L2 (.cg: not a stale L1 line)
          "mma_gemm split": ["mma.sync", "cp.async"], "mma_gemm swap": ["wgmma", "cp.async"],
          "mma_gemm split4": ["atom.global.gpu.acq_rel.add", "ld.global.cg"],
          "mma_gemm swap split4": ["atom.global.gpu.acq_rel.add", "ld.global.cg"],
          "resnorm_gemm nb3 split1": ["mma.sync", "cp.async"], "resnorm_gemm nb3 swap": ["wgmma", "cp.async"],
          "resnorm_gemm nb3 split2": ["atom.global.gpu.acq_rel.add", "ld.global.cg"],
          "pushed ar_residual_norm": ["sys.acquire"], "loop ": SEQ_PTX,
          # the grid barrier: a gpu-scope acq_rel arrival, the partials read back from L2 (.cg)
          "cols ": ["atom.global.gpu.acq_rel.add", "ld.global.cg"], "cols ar_norm w8": SEQ_PTX,
          "cols latent_tail w8": SEQ_PTX}
# (a, b): the first `a` in the PTX comes before the first `b`. The PDL GEMV issues a weight load
# before it waits for the previous kernel.
ORDER = {"gemv pdl": [("ld.global", "griddepcontrol.wait")],
         # the L2 prefetch is issued before the wait (that is its point)
         "gemv pdl pf": [("cp.async.bulk.prefetch.L2.global", "griddepcontrol.wait")],
         # the trigger comes before the kernel's first load
         "trigger ar_residual_norm": [("griddepcontrol.launch_dependents", "ld.global")],
         "trigger latent_tail": [("griddepcontrol.launch_dependents", "ld.global")],
         # the weight rows' prefetch, then the wait, before the first weight or x tile is loaded
         "mma_gemm pdl pf": [("cp.async.bulk.prefetch.L2.global", "griddepcontrol.wait"),
                             ("griddepcontrol.wait", "cp.async.cg")],
         # the CTA barrier after the partial stores comes before the counting atomic
         "mma_gemm split4": [("bar.sync", "atom.global")], "mma_gemm swap split4": [("bar.sync", "atom.global")],
         # the program's partials stored, then its arrival (after a CTA barrier)
         "cols ar_norm w1": [("st.global", "atom.global.gpu.acq_rel.add")],
         # the CTA barrier after the window loads comes before the count
         "kda_step_decode p4": [("bar.sync", "atom.global.gpu.acq_rel.add")]}
# PTX each kernel family must not contain: v2b multiplies fp32 subnormals (+-0.5 * 2^-126), so no
# flush-to-zero on its float multiplies / FMAs. (v3's subnormal bf16 / fp16 operands go to the
# MMA, which has no ftz form; its fp32 multiplies take normal numbers. v3's tl.dot path is never the fp32
# interpreter one on the GPU: DOT_F32=0 in these entries.)
FORBID = {"mxfp4_v2b": ["mul.ftz.f32", "fma.rn.ftz.f32", "mul.rn.ftz.f32"],
          "kda_step_decode p1": ["atom.global"],   # one program per head: no counter
          "pushed ar_residual_norm": ["sys.release.exch"]}   # the push path sends no barrier signal


# --quick: one variant of each communication kernel at WORLD=2, the prefetch and every expert kernel
QUICK = ("ar_residual_norm w2 nb3 res1", "kda_conv", "kda_decode_fb", "kda_step", "pushed ar_residual_norm w2", "latent_tail w2", "gather w2", "cas ", "loop ", "l2_prefetch", "mxfp4", "router_topk", "situ",
         "gemv pdl", "gemv lazy", "mma_gemm", "resnorm_gemm", "mla_", "cols ")


def main(argv=None) -> int:
    import sys
    quick = "--quick" in (argv if argv is not None else sys.argv[1:])
    bad = 0
    for name, fn, types, consts in variants():
        if quick and not name.startswith(QUICK):
            continue
        ptx = compile_one(fn, types, consts, aligned=name.startswith(("mxfp4", "mma_gemm", "resnorm_gemm"))).asm["ptx"]
        missing = [i for key, ins in EXPECT.items() if name.startswith(key) for i in ins if i not in ptx]
        missing += [f"forbidden {i}" for key, ins in FORBID.items() if name.startswith(key) for i in ins if i in ptx]
        missing += [f"{a} before {b}" for key, pairs in ORDER.items() if name.startswith(key) for a, b in pairs
                    if not (a in ptx and b in ptx and ptx.index(a) < ptx.index(b))]
        bad += bool(missing)
        print(f"{name}: {'MISSING ' + ', '.join(missing) if missing else 'ok'} ({len(ptx)} chars of PTX)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
