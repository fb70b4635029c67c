"""MoE: the router top-k, the shared expert's SiTU, the MXFP4 routed experts (Triton kernels of
kernels/triton_moe.py, or the CuTe GEMVs of kernels/cute/mxfp4_experts.py, chosen by M), and their
`k3::` registrations.

- router_topk: one Triton kernel per call (kernels/triton_router.py: sigmoid, biased top-k,
  renormalised weights).
- mxfp4_experts: the CuTe f16x2 GEMVs (`cute_h2`) at the batches of `tuning.CUTE_M` where an
  artifact fits, else two Triton kernels (gate-up + SiTU, down) dequantising MXFP4 in registers:
  v3, or v4g (pairs grouped by expert) at `tuning.MXFP4_GROUPED_MIN_N`..`MAX_N` tokens
  (`mxfp4_variant`; K3_KNOBS mxfp4 forces a variant).
- shared_expert_async / stream_join: the side-stream shared expert (GEMM, one SiTU kernel, GEMM),
  joined by an event (`runtime.streams`).
"""
from __future__ import annotations

import torch
import triton

from ..config import knob, knob_flag
from ..model.functional import situ_mlp as model_situ_mlp
from ..runtime import streams
from . import gemm, triton_moe, triton_router, tuning
from .common import FLOAT
from .cute import artifacts
from .registry import register

def situ(gate_up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """model.functional.situ of a 2-D contiguous [M, 2I] tensor in one Triton kernel."""
    M, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(M, I, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    if M and I:
        triton_moe.situ_kernel[(M, triton.cdiv(I, BLOCK))](
            gate_up, out, M, I, float(beta), float(linear_beta), BLOCK=BLOCK, num_warps=4)
    return out


def situ_mlp(x, w_gate_up, w_down, beta: float, linear_beta: float) -> torch.Tensor:
    """The shared expert (model.functional.situ_mlp's math): GEMM, the SiTU kernel, GEMM."""
    gu = gemm.gemm("shared_gate_up", x, w_gate_up)
    return gemm.gemm("shared_down", situ(gu, beta, linear_beta), w_down)


def situ_mlp2(x, w_gate, w_up, w_down, beta: float, linear_beta: float) -> torch.Tensor:
    """The shared expert with separate gate and up weights: both GEMMs into one [M, 2I] buffer, the
    SiTU kernel, the down GEMM."""
    x2 = x.reshape(-1, x.shape[-1])
    gu = torch.cat([gemm.gemm("shared_gate_up", x2, w_gate), gemm.gemm("shared_gate_up", x2, w_up)], -1)
    out = gemm.gemm("shared_down", situ(gu, beta, linear_beta), w_down)
    return out.reshape(*x.shape[:-1], w_down.shape[0])


ROUTER_TOPK_MAX_E = 4096  # one row in one program's registers


def _router_sort() -> bool:
    return knob_flag("router_sort", tuning.ROUTER_SORT)


def router_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, scale: float, ids_dtype=torch.int64,
                sort: bool | None = None):
    """(ids [M, k] of ids_dtype (int64 or int32), weights fp32 [M, k]) of the K3 router
    (triton_router's docstring)."""
    M, E = logits.shape
    ids = torch.empty(M, k, dtype=ids_dtype, device=logits.device)
    w = torch.empty(M, k, dtype=torch.float32, device=logits.device)
    if M:
        if sort is None:
            sort = _router_sort()
        triton_router.router_topk_kernel[(M,)](
            logits, bias, ids, w, E, float(scale), K=k, KP=triton.next_power_of_2(k),
            BLOCK=triton.next_power_of_2(E), SORT=sort,
            num_warps=(8 if E <= 1024 else 16) if sort else (4 if E <= 1024 else 8))
    return ids, w


def _divisor(n: int, options=(128, 64, 32, 16)) -> int:
    return next((b for b in options if n % b == 0), 0)


MXFP4_VARIANTS = ("v1", "dot", "v2b", "v3", "v3g", "v4g", "cute", "cute_h2")
# v3g / v4g group the pairs by expert in one program over all P = M * top-k expert ids and all experts
# (mxfp4_experts_ok refuses more of either)
MXFP4_GROUPED_MAX_P = 8192
# "cute" / "cute_h2": the AOT-built CuTe DSL GEMVs (kernels/cute/mxfp4_experts.py, fp32 / f16x2
# math, through the driver-only loader); where no artifact fits (or not CUDA / not bf16 /
# misaligned) they run the Triton default (CUTE_FALLBACK, or v4g at tuning.MXFP4_GROUPED_MIN_N..MAX_N
# tokens) and cute.artifacts.fallbacks() says why
CUTE_FALLBACK = "v3"


def mxfp4_variant(variant: str | None = None, x: torch.Tensor | None = None, I: int | None = None,
                  N: int | None = None) -> str:
    """The expert-kernel variant: the argument, else env K3_KNOBS mxfp4, else the default: for bf16
    activations where v3's tiles fit the shapes, "cute_h2" (the CuTe f16x2 GEMVs) on CUDA at the
    batch sizes tuning.CUTE_M measured it faster (it falls back to v3 / v4g, with the reason, where
    no artifact fits), else "v3", or "v4g" from MXFP4_GROUPED_MIN_N tokens (v3 with the pairs
    grouped by expert) (v3: 1.5-2.0x faster than v2b on the H200, BENCHMARKS.md; both round the
    activations and the SiTU output to bf16 / fp16, which a bf16 model does anyway); other
    activations and shapes "v2b" (fp32 products of the exact activations)."""
    v = variant or knob("mxfp4") or None
    if v is None:
        v = "v3" if x is None else default_mxfp4_variant(x.dtype == torch.bfloat16, x.shape[1], I, x.is_cuda, N)
    if v not in MXFP4_VARIANTS:
        raise ValueError(f"unknown MXFP4 expert variant {v!r} (one of {MXFP4_VARIANTS})")
    return v


def default_mxfp4_variant(bf16: bool, L: int, I: int, cuda: bool, N: int | None) -> str:
    """The default expert kernel for these activations and shapes (mxfp4_variant's rule; the match
    report's kernel note, experts_note, asks the same)."""
    if not bf16 or _mxfp4_tiles("v3", L, I, None) is None:
        return "v2b"
    if cuda and N is not None and artifacts.wanted("mxfp4_experts", N):
        return "cute_h2"
    return _triton_mxfp4(N)


def _triton_mxfp4(N: int | None) -> str:
    """The Triton expert kernel for bf16 activations at N tokens (unknown N: v3)."""
    grouped = N is not None and tuning.MXFP4_GROUPED_MIN_N <= N <= tuning.MXFP4_GROUPED_MAX_N
    return "v4g" if grouped else CUTE_FALLBACK


def _mxfp4_tiles(variant: str, L: int, I: int, tiles: dict | None) -> dict | None:
    """Tile sizes and launch options of one variant for these shapes (defaults, overridden by
    `tiles`), or None when the shapes do not fit.
      gate_up: rows per program (BI/BN, of gate and of up each), bytes per k step BKB_GU;
      down:    rows per program BL/BN_D, bytes per k step BKB_D; num_warps, num_stages (None:
      Triton's default); dot and v2b: LOOP (0 unrolled k loop, 1 pipelined tl.range loop)."""
    t = dict(tiles or {})
    if variant.startswith("cute"):   # the tiles are compiled into the artifacts; these are the fallback's
        variant = CUTE_FALLBACK
    if variant == "dot":
        # dot_scaled tiles: k steps of >= 32 elements (16 bytes, one scale), rows a multiple of 16
        d = dict(BN=_divisor(I, (64, 32, 16)), BKB_GU=_divisor(L // 2, (64, 32, 16)), BN_D=_divisor(L, (64, 32, 16)),
                 BKB_D=_divisor(I // 2, (64, 32, 16)), BT=16, LOOP=0, num_warps=4, num_stages=None)
    elif variant == "v3":
        # rows per program BI (gate and up each: the MMA's M is 2*BI) / BL, k step BKB bytes (a
        # multiple of 64: whole 16-word groups; BKB/16 scale blocks <= BT = the MMA's N, one column
        # per block); always the pipelined loop. Defaults from SASS counts only (bench/sass_count.py),
        # not timed yet: BI=32 keeps 192 programs at M=1 (TP=8); BI=64 issues ~5% fewer per byte
        d = dict(BI=_divisor(I, (32, 16)), BKB_GU=_divisor(L // 2, (256, 128, 64)), BL=_divisor(L, (128, 64)),
                 BKB_D=_divisor(I // 2, (64,)), BT=16, FP16=0, num_warps=4, num_stages=3)
    elif variant == "v3g":
        # v3's k loop over pairs grouped by expert, TG pairs per tile: the MMA's N is BKB/16 * TG
        # (one column per scale block and pair), so k steps stay short (64 bytes: N = 4 * TG)
        d = dict(BI=_divisor(I, (32, 16)), BKB_GU=64, BL=_divisor(L, (128, 64)), BKB_D=64, TG=8, FP16=0,
                 PROGS=132 * 16, num_warps=4, num_stages=3)
    elif variant == "v4g":
        # v3g's loop, the scales in the A tile: the MMA's N is TG (one column per pair), so k steps
        # can be long (BKB_GU / BKB_D bytes, multiples of 64); TG >= 16 (tl.dot's smallest N)
        d = dict(BI=_divisor(I, (32, 16)), BKB_GU=_divisor(L // 2, (128, 64)), BL=_divisor(L, (128, 64)),
                 BKB_D=_divisor(I // 2, (128, 64)), TG=16, FP16=0, PROGS=132 * 8, MUL2=1,
                 num_warps=4, num_stages=3)
    elif variant == "v2b":
        d = dict(BI=_divisor(I, (16,)), BKB_GU=_divisor(L // 2, (256, 128, 64, 32, 16)), BL=_divisor(L, (32, 16)),
                 BKB_D=_divisor(I // 2, (64, 32, 16)), LOOP=0, num_warps=4, num_stages=None)
    else:
        d = dict(BI=_divisor(I, (16,)), BKB_GU=_divisor(L // 2), BL=_divisor(L, (32,)),
                 BKB_D=_divisor(I // 2, (64, 32, 16)), num_warps=4, num_stages=None)
    d.update(t)
    rows_gu, rows_d = (d["BN"], d["BN_D"]) if variant == "dot" else (d["BI"], d["BL"])
    ok = (rows_gu > 0 and rows_d > 0 and d["BKB_GU"] >= 16 and d["BKB_D"] >= 16 and I % rows_gu == 0
          and L % rows_d == 0 and (L // 2) % d["BKB_GU"] == 0 and (I // 2) % d["BKB_D"] == 0
          and all(n & (n - 1) == 0 for n in (rows_gu, rows_d, d["BKB_GU"], d["BKB_D"])))  # tl.arange: powers of 2
    if variant == "v3":  # one MMA column per scale block of a k step
        ok = (ok and d["BKB_GU"] >= 64 and d["BKB_D"] >= 64 and d["BKB_GU"] // 16 <= d["BT"]
              and d["BKB_D"] // 16 <= d["BT"] and d["BT"] >= 16 and rows_gu >= 16 and rows_d >= 16)
    if variant in ("v3g", "v4g"):  # v3g: one MMA column per scale block and pair: N = BKB / 16 * TG >= 16
        tg = d["TG"]
        n_gu, n_d = (tg, tg) if variant == "v4g" else (d["BKB_GU"] // 16 * tg, d["BKB_D"] // 16 * tg)
        ok = (ok and tg >= 1 and tg & (tg - 1) == 0 and d["PROGS"] >= 1 and d["BKB_GU"] >= 64 and d["BKB_D"] >= 64
              and n_gu >= 16 and n_d >= 16 and rows_gu >= 16 and rows_d >= 16
              and (variant == "v3g" or d["FP16"] == 0)    # v4g: bf16 tiles only
              and d.get("MUL2", 0) in (0, 1))
    return d if ok else None


def _v4g_operand(x: torch.Tensor) -> torch.Tensor:
    """v4g's gate-up B operand (triton_moe.v4g_operand_kernel): x's columns in the A tile's K order,
    times 2^63, in bf16 (fp32 on the CPU interpreter's fp32 dot path)."""
    N, L = x.shape
    out = torch.empty(N, L, dtype=torch.bfloat16 if x.is_cuda else torch.float32, device=x.device)
    triton_moe.v4g_operand_kernel[(N, triton.cdiv(L, 1024))](x, out, L, BLOCK=1024)
    return out


def mxfp4_experts_ok(x, topk_ids, w13, variant: str | None = None, tiles: dict | None = None) -> bool:
    """Shapes the MXFP4 expert kernels of `variant` take: L % 32 == 0, I % 32 == 0 (row bytes split
    into 16-byte scale blocks) and row/byte tiles that divide I, L, L/2 and I/2."""
    L, I = x.shape[1], w13.shape[1] // 2
    v = mxfp4_variant(variant, x, I)
    return (x.dim() == 2 and x.is_contiguous() and L % 32 == 0 and I % 32 == 0
            and _mxfp4_tiles(v, L, I, tiles) is not None
            and (v not in ("v3g", "v4g") or max(topk_ids.numel(), w13.shape[0]) <= MXFP4_GROUPED_MAX_P))


def mxfp4_experts(x, topk_ids, w13, w13_scale, w2, w2_scale, beta: float, linear_beta: float,
                  variant: str | None = None, tiles: dict | None = None):
    """Unweighted routed-expert outputs [N, k, L] (the k3model::mxfp4_experts contract).
    variant: "v1" | "dot" | "v2b" | "v3" | "cute" | "cute_h2" (default env K3_KNOBS mxfp4, else
    mxfp4_variant's choice; see triton_moe's docstring and kernels/cute/mxfp4_experts.py);
    tiles: overrides of the variant's tile sizes / num_warps / num_stages (_mxfp4_tiles); None
    takes MXFP4_TUNED's tiles for this batch where they fit."""
    N, K = topk_ids.shape
    L, I = x.shape[1], w13.shape[1] // 2
    variant = mxfp4_variant(variant, x, I, N)
    if variant.startswith("cute"):
        out = mxfp4_experts_cute(x, topk_ids, w13, w13_scale, w2, w2_scale, beta, linear_beta,
                                        math="f16x2" if variant == "cute_h2" else "f32")
        if out is not None:
            return out
        variant = _triton_mxfp4(N)
    P = N * K
    out = torch.empty(N, K, L, dtype=x.dtype, device=x.device)
    if P == 0:
        return out
    d = None
    if tiles is None:
        tuned = next((t for bound, t in tuning.MXFP4_TUNED.get(variant, ()) if N <= bound), None)
        d = _mxfp4_tiles(variant, L, I, tuned) if tuned else None
    d = d or _mxfp4_tiles(variant, L, I, tiles)
    if d is None:
        raise ValueError(f"MXFP4 experts variant {variant}: shapes L={L} I={I} do not fit tiles {tiles}")
    # fp32 SiTU outputs; v4g's are down's bf16 B operand (its gate-up rounds them to bf16 anyway)
    mid = torch.empty(P, I, dtype=torch.bfloat16 if variant == "v4g" and x.is_cuda else torch.float32,
                      device=x.device)
    ids = topk_ids.reshape(-1).contiguous()
    opts = dict(num_warps=d["num_warps"])
    if d["num_stages"] is not None:
        opts["num_stages"] = d["num_stages"]
    if variant == "v3":
        # DOT_F32: the CPU interpreter's bf16 tl.dot is broken; there both operands (the same bit
        # patterns) are upcast to fp32 for the dot. Never on the GPU.
        v3 = dict(BT=d["BT"], FP16=d["FP16"], DOT_F32=int(not x.is_cuda), **opts)
        triton_moe.mxfp4_gate_up_v3_kernel[(P, I // d["BI"])](
            x, ids, w13, w13_scale, mid, K, I, L, float(beta), float(linear_beta), BI=d["BI"], BKB=d["BKB_GU"], **v3)
        triton_moe.mxfp4_down_v3_kernel[(P, L // d["BL"])](
            mid, ids, w2, w2_scale, out, I, L, BL=d["BL"], BKB=d["BKB_D"], **v3)
        return out
    if variant in ("v3g", "v4g"):
        if max(P, w13.shape[0]) > MXFP4_GROUPED_MAX_P:
            raise ValueError(f"MXFP4 experts {variant} groups at most {MXFP4_GROUPED_MAX_P} (token, expert) pairs "
                             f"of as many experts in one program; got {P} pairs, {w13.shape[0]} experts: use v3")
        # group the pairs by expert (one program), then the GEMVs' programs loop over the tiles
        order, sorted_e, tstart = (torch.empty(P, dtype=torch.int32, device=x.device) for _ in range(3))
        EB = triton.next_power_of_2(w13.shape[0])
        ws = torch.empty(3 * EB, dtype=torch.int32, device=x.device)
        triton_moe.mxfp4_group_count_kernel[(1,)](
            ids, order, sorted_e, tstart, ws, P, PB=triton.next_power_of_2(P), EB=EB, TG=d["TG"],
            num_warps=4 if P <= 1024 else 8)
        g = dict(TG=d["TG"], FP16=d["FP16"], DOT_F32=int(not x.is_cuda),
                 V4=0 if variant == "v3g" else 2 if d["MUL2"] else 1, **opts)
        xg = x
        if variant == "v4g":   # B operands in the A tile's K order, times 2^63 (triton_moe: v4g)
            xg = _v4g_operand(x)
        # persistent over the tiles (at most P of them): about PROGS programs in all
        rb_gu, rb_d = I // d["BI"], L // d["BL"]
        triton_moe.mxfp4_gate_up_v3g_kernel[(min(P, -(-d["PROGS"] // rb_gu)), rb_gu)](
            xg, order, sorted_e, tstart, w13, w13_scale, mid, P, K, I, L, float(beta), float(linear_beta),
            BI=d["BI"], BKB=d["BKB_GU"], **g)
        triton_moe.mxfp4_down_v3g_kernel[(min(P, -(-d["PROGS"] // rb_d)), rb_d)](
            mid, order, sorted_e, tstart, w2, w2_scale, out, P, I, L, BL=d["BL"], BKB=d["BKB_D"], **g)
        return out
    if variant != "v1":
        opts["LOOP"] = d["LOOP"]
    if variant == "dot":
        triton_moe.mxfp4_gate_up_dot_kernel[(P, I // d["BN"])](
            x, ids, w13, w13_scale, mid, K, I, L, float(beta), float(linear_beta), BN=d["BN"], BKB=d["BKB_GU"],
            BT=d["BT"], **opts)
        triton_moe.mxfp4_down_dot_kernel[(P, L // d["BN_D"])](
            mid, ids, w2, w2_scale, out, I, L, BN=d["BN_D"], BKB=d["BKB_D"], BT=d["BT"], **opts)
        return out
    gu, dn = ((triton_moe.mxfp4_gate_up_v2b_kernel, triton_moe.mxfp4_down_v2b_kernel) if variant == "v2b"
              else (triton_moe.mxfp4_gate_up_kernel, triton_moe.mxfp4_down_kernel))
    gu[(P, I // d["BI"])](x, ids, w13, w13_scale, mid, K, I, L, float(beta), float(linear_beta),
                          BI=d["BI"], BKB=d["BKB_GU"], **opts)
    dn[(P, L // d["BL"])](mid, ids, w2, w2_scale, out, I, L, BL=d["BL"], BKB=d["BKB_D"], **opts)
    return out


def mxfp4_tag(I: int, N: int) -> str:
    """The f16x2 MXFP4 kernels' tag (build.MXFP4_TAGS) dispatch takes for N tokens at width I."""
    if N <= tuning.CUTE_MXFP4_LDG.get(I, 0):
        return "ldgd"
    return "xf" if N <= tuning.CUTE_XF_MAX_N else ""


def cute_pdl() -> bool:
    """Whether the CuTe MXFP4 down kernel is launched with PDL (tuning.CUTE_PDL; K3_KNOBS=cute_pdl=0: off)."""
    flag = knob("cute_pdl")
    return tuning.CUTE_PDL if flag == "" else flag != "0"


def mxfp4_experts_cute(x, topk_ids, w13, w13_scale, w2, w2_scale, beta, linear_beta, math: str = "f32"):
    """The MXFP4 routed experts through the CuTe artifacts of `math` ("f32" | "f16x2";
    mxfp4_experts(variant="cute" | "cute_h2")), or None (the caller falls back to Triton)
    with the reason in cute.artifacts.fallbacks()."""
    N, K = topk_ids.shape
    L, I = x.shape[1], w13.shape[1] // 2
    forced = (knob("cute_mxfp4_tag") or None)   # benchmarks: a variant of build.MXFP4_TAGS, "none": untagged
    tag = forced if forced is not None else (mxfp4_tag(I, N) if math == "f16x2" else "")
    tag = "" if tag == "none" else tag
    key = f"mxfp4_experts I={I} L={L} K={K}" + ("" if math == "f32" else f" {math}") + (f" {tag}" if tag else "")
    if not x.is_cuda:
        artifacts.note(key, "not CUDA (the CuTe kernels are sm_90a cubins)")
        return None
    if x.dtype != torch.bfloat16:
        artifacts.note(key, f"dtype {x.dtype} (the CuTe MXFP4 kernels take bf16 activations)")
        return None
    try:
        from .cute import loader
        arts, why = artifacts.find("mxfp4", I, L, K, math, tag)
        if arts is None and tag and forced is None:
            # dispatch's variant is not there (an artifact directory built before it, no DSL to
            # build it): the untagged kernels of the same math, with the reason recorded
            arts = artifacts.find("mxfp4", I, L, K, math, "")[0]
            if arts is not None:
                artifacts.note(key, why, "running the untagged CuTe kernels")
        if arts is None:
            artifacts.note(key, why)
            return None
        return loader.mxfp4_experts(*arts, x.contiguous(), topk_ids, w13, w13_scale, w2, w2_scale,
                                    float(beta), float(linear_beta), pdl=cute_pdl())
    except Exception as e:  # noqa: BLE001 - any loader failure falls back, with the reason
        artifacts.note(key, f"loader error: {type(e).__name__}: {e}")
        return None


def experts_note(I: int, L: int, K: int, M: int | None, bf16: bool) -> str:
    """Which MXFP4 expert kernel a graph's routed experts will run, and why not CuTe (for the
    match report, at compile time: default_mxfp4_variant, the rule applied at run time)."""
    forced = knob("mxfp4")
    if forced:
        return f"MXFP4 experts: {forced} (K3_KNOBS mxfp4)"
    lo, hi = tuning.CUTE_M.get("mxfp4_experts", (1, 0))
    v = default_mxfp4_variant(bf16, L, I, True, lo if M is None else M)  # dynamic M: CuTe from its lowest M
    if v == "v2b":
        return ("MXFP4 experts: Triton v2b (activations not bf16)" if not bf16
                else f"MXFP4 experts: Triton v2b (v3's tiles do not fit I={I} L={L})")
    if v in ("v3", "v4g"):
        name = "Triton v3" if v == "v3" else "Triton v4g (pairs grouped by expert)"
        if M is None:
            return f"MXFP4 experts: {name} (" + ("K3_KNOBS=cute=0)" if knob("cute") == "0" else "no CuTe range)")
        return f"MXFP4 experts: {name} (M={M}; CuTe at M in [{lo}, {hi}])"
    try:   # no JIT build for a report: the first call builds
        arts, why = artifacts.find("mxfp4", I, L, K, "f16x2", jit=False)
        jit = arts is None and not artifacts.jit_variants("mxfp4", (I, L, K, "f16x2"))[1]
    except Exception as e:  # noqa: BLE001 - a broken artifact directory is a reason, not a crash
        arts, why, jit = None, f"loader error: {type(e).__name__}: {e}", False
    if arts is None and not jit:
        return f"MXFP4 experts: Triton {_triton_mxfp4(M)} ({why})"
    where = "" if M is not None else f" at M in [{lo}, {hi}], Triton v4g above (M is dynamic)"
    src = f"built just in time on the first call into {artifacts.artifact_dir()}" if jit else artifacts.source(arts[0])
    return f"MXFP4 experts: CuTe f16x2 GEMVs{where} ({src})"


# ------------------------------------------------------------------ registrations
def _topk_ok(E, bias, k):
    """The router top-k kernel's selection over E experts: the bias, k and E it takes."""
    return (bias.dim() == 1 and bias.is_contiguous() and bias.dtype in FLOAT and bias.shape[0] == E
            and 0 < k <= min(64, E) and E <= ROUTER_TOPK_MAX_E)


def _ok_topk(logits, bias, k, scale, ids_int32=False, after=None):
    return (logits.dim() == 2 and logits.is_contiguous() and logits.dtype in FLOAT
            and _topk_ok(logits.shape[1], bias, k))


@register("router_topk", "cuda", "triton_router_topk", _ok_topk)
def _router_topk(logits, bias, k, scale, ids_int32=False, after=None):
    return router_topk(logits, bias, k, scale, torch.int32 if ids_int32 else torch.int64)


def _ok_experts(x, topk_ids, w13, w13_scale, w2, w2_scale, beta, linear_beta):
    return x.dtype in FLOAT and mxfp4_experts_ok(x, topk_ids, w13)


@register("mxfp4_experts", "cuda", "triton_mxfp4", _ok_experts)
def _experts(x, topk_ids, w13, w13_scale, w2, w2_scale, beta, linear_beta):
    return mxfp4_experts(x, topk_ids, w13, w13_scale, w2, w2_scale, beta, linear_beta)


@register("shared_expert_async", "cuda", "side_stream")
def _shared_expert_async(x, w_gate_up, w_down, beta, linear_beta, after=None, w_up=None):
    if w_up is not None:   # separate gate and up weights: both GEMMs, then the SiTU and down GEMM, on the side stream
        return streams.fork(situ_mlp2, x, w_gate_up, w_up, w_down, beta, linear_beta)
    return streams.fork(situ_mlp if x.dim() == 2 else model_situ_mlp, x, w_gate_up, w_down, beta, linear_beta)


@register("stream_join", "cuda", "event_wait")
def _stream_join(x, after):
    streams.join(x)
    return x.clone()
