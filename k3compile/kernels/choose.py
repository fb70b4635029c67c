"""CuTe or the default path (cuBLAS / Triton), per op and M.

`CUTE_M[op] = (lo, hi)`: the M range where the CuTe kernel measured faster on the GPU
(BENCHMARKS.md). `mxfp4_experts`: the CuTe f16x2 GEMVs (`cute_h2`) were 1.14-1.38x faster than
Triton v3 at every measured M (TP=8 shapes M=1/4/16/64, TP=2 M=1/16; one H200),
so they are the default there for bf16 activations; up to M=128 after later
runs (uniform routing, TP=8 / TP=2 shapes): 1.4-1.6x v3 at M = 96, 128, 256, and faster than
the expert-grouped v3g up to M=128 (at 128: 1.14x / 1.02x), slower from 192 (0.92x / 0.77x),
where the grouped Triton kernel is the default (v4g, 1.4-1.5x v3g at
M=256; up to launch.MXFP4_GROUPED_MAX_N = 256, the largest M run). With skewed routing v3g was faster from
M=16 on, but dispatch cannot see the routing. `oproj` (the skinny GEMM) has no range: it
measured equal to cuBLAS at best. `oproj_push` (the skinny GEMM with the push all-reduce
epilogue, `push_gemm`) has none: on 2 x H200 (cold weights, 3 AttnRes blocks) the op was
within 0.5 us of the pull path at TP=8 shapes M = 1..64 (22.1 vs 22.6 us at M=1), and the KDA /
MLA layers with it within their rounds' spread (+2.1 / +2.4 us at M=1). `K3_KNOBS=cute=1` forces CuTe wherever an artifact fits, `K3_KNOBS=cute=0`
turns it off; `K3_CUTE_DIR` is where `python -m k3compile.kernels.cute.build` put the artifacts.
JIT: where the DSL is installed and no artifact fits a wanted shape that the build has a variant
for (`build.jit_variants`), the first call builds it into that directory (`build.ensure`: the AOT
build's code, cache key and checks) and loads it; `K3_KNOBS=cute_jit=0` turns this off, and it never
runs inside a CUDA graph capture (warm up eagerly first). Run on the H200 (BENCHMARKS.md).
When CuTe was chosen but cannot run (no artifact for the shape and no JIT build, not CUDA, wrong
dtype, JIT build or loader error) the op falls back to its default path (Triton v3 for the
experts, cuBLAS for the GEMM), warns once per reason, and `fallbacks()` lists the reasons.
"""
from __future__ import annotations

import functools
import warnings

import torch
from ..config import knob

# mxfp4_experts up to 79: with v4g's bf16x2 scale (TP=8 / TP=2
# shapes, cold routings, cute_h2 / v4g us) M=64: 551 / 620, 2220 / 2232; M=80: 683 / 687, 2795 / 2473;
# M=96: 811 / 754, 3308 / 2696. (Before that form: up to 96.)
CUTE_M: dict[str, tuple[int, int]] = {"mxfp4_experts": (1, 79)}   # from GPU benchmark runs (docstring)
# Programmatic Dependent Launch of the CuTe MXFP4 down kernel (it starts while gate-up drains): on at
# every batch. Measured with a different routing each call, as in a model (`experts_bench.py --cold 8`,
# one H200, each case 4 times in alternating order; BENCHMARKS.md): TP=8 shapes (I=384)
# M = 1/2/4/8 -0.2/-1.5/-1.9/-2.0 us with it, TP=2 shapes (I=1536) -1.7/-1.4/0.0/-6.7 us. (With the same
# routing every call, M=1 at TP=8 had been 0.9-1.3 us slower with it: its 35 MB of experts
# stayed in the L2 between calls.) K3_KNOBS=cute_pdl=0 turns it off.
_WHY: dict[str, str] = {}


def _note(key: str, why: str, then: str = "running the default path") -> None:
    """Record why a wanted CuTe kernel did not run; warn the first time for each op/shape."""
    if key not in _WHY:
        _WHY[key] = why
        warnings.warn(f"k3: CuTe kernel not used for {key}: {why}; {then}", stacklevel=3)


def wanted(op: str, m: int) -> bool:
    flag = knob("cute")
    if flag == "0":
        return False
    if flag not in ("", "0"):
        return True
    lo, hi = CUTE_M.get(op, (1, 0))
    return lo <= m <= hi


# the CuTe f16x2 gate-up with its activation loads before the first cp.async wait ("xf") up to this
# many tokens: 1.0-1.8 us faster at 1 token, 0.1-0.6 us at 2, mixed at 4, slower at 8-16 (cold
# routings, one H200: bench/results/experts_alt_cold8_h200_bab4aec.json)
CUTE_XF_MAX_N = 2
# the register-staged kernels ("ldgd", build.MXFP4_TAGS) up to this many tokens, by per-rank expert
# width I. Cold routings, one H200, alternating repeats in one run (bench/results/experts_alt_cold8_h200_*):
# with 8 + 8 gate-up rows per CTA against the kernels dispatch took before (xf up to 2
# tokens, untagged above), TP=8 (I=384) M = 1/2/4/8/16: 1.16 / 1.12-1.13 / 1.11 / 1.04-1.07 /
# 1.07-1.12x; the 16 + 16 rows now built against those 8 + 8: TP=8 1.01-1.04x at M <= 16,
# and against the old kernels at TP=2 (I=1536) M = 2/4/8/16: 1.03 / 1.05-1.08 / 1.05-1.11 /
# 1.04-1.08x (M=1: 1.02-1.03x over the 8 + 8 rows, which were 1.03-1.05x over xf). Not run above 16.
CUTE_MXFP4_LDG = {384: 16, 1536: 16}


def mxfp4_tag(I: int, N: int) -> str:
    """The f16x2 MXFP4 kernels' tag (build.MXFP4_TAGS) dispatch takes for N tokens at width I."""
    if N <= CUTE_MXFP4_LDG.get(I, 0):
        return "ldgd"
    return "xf" if N <= CUTE_XF_MAX_N else ""


def cute_pdl() -> bool:
    """Whether the CuTe MXFP4 down kernel is launched with PDL (on unless K3_KNOBS=cute_pdl=0)."""
    return knob("cute_pdl") != "0"


def fallbacks() -> dict[str, str]:
    """op/shape -> why a wanted CuTe kernel did not run."""
    return dict(_WHY)


def _artifact_dir():
    from .cute.build import default_dir
    return default_dir()


_FOUND: dict[tuple, tuple] = {}


def _jit_variants(kind: str, key: tuple) -> tuple[list[dict], str]:
    """The build variants the JIT path would compile for this lookup, or ([], why it cannot)."""
    from . import cute
    if knob("cute_jit") == "0":
        return [], "JIT build off (K3_KNOBS=cute_jit=0)"
    if not cute.dsl_available():
        return [], "no JIT build: the CuTe DSL is not installed"
    from .cute.build import jit_variants
    vs = jit_variants(kind, *key)
    return vs, "" if vs else "no JIT build: the CuTe build has no variant for these shapes"


def _find(kind: str, *key, jit: bool = True):
    """loader.find / loader.find_mxfp4, memoised per (artifact dir, shapes): an Artifact reads its
    cubin and loads the module on first launch, so a fresh one per call would re-read the files
    and load a new module every call (and cuModuleLoadData inside a CUDA-graph capture).
    Where nothing fits, the JIT path builds the variants (build.ensure) and looks again, unless
    `jit` is False or a CUDA graph is being captured: those misses are not memoised, so a later
    call can still build."""
    from .cute import loader
    d = _artifact_dir()
    k = (kind, str(d), *key)
    if k not in _FOUND:
        fn = loader.find if kind == "gemm" else loader.find_mxfp4
        got = fn(d, *key)
        if got[0] is None:
            vs, why = _jit_variants(kind, key)
            if why:
                got = None, f"{got[1]}; {why}"
            elif not jit:
                return got
            elif torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return None, f"{got[1]}; not built just in time inside a CUDA graph capture"
            else:
                from .cute import build
                try:
                    for v in vs:
                        build.ensure(v, d)
                    got = fn(d, *key)
                except Exception as e:  # noqa: BLE001 - a failed build falls back, with the reason
                    got = None, f"JIT build failed: {type(e).__name__}: {e}"
        _FOUND[k] = got
    return _FOUND[k]


CUTE_GEMM_OPS = ("oproj",)  # the GEMMs the CuTe skinny GEMM was built for (N = hidden)

# The Triton decode GEMMs (kernels/triton_gemv.py) instead of cuBLAS, by weight shape (N, K):
# {M: config name, or None where cuBLAS measured at least as fast}; a call with M takes the entry of
# the smallest measured M >= M (none: cuBLAS). Config names as bench/gemv_bench.py writes them
# ("mma[s] BN/BK/SPLIT/warps/stages": the tensor-core split-K kernel; "gemv BN/BK/warps/stages":
# the CUDA-core GEMV). From the sweep in bench/results/gemv_mma_h200_3aa472c.json (one
# H200, cold weights, graphed; BENCHMARKS.md): an entry where the best config
# was >= 1.03x cuBLAS, None below; checked again against cuBLAS (other weights, 3
# alternating repeats, M = 1 / 2 / 4 / 8 / 16): every entry 1.04-1.53x but (6144, 7168) at M=2, 0.99x. These are the per-rank shapes of the layer bench
# (TP=8 widths on 2 GPUs, and TP=2); every other shape runs cuBLAS. K3_KNOBS=gemv_table=<gemv_bench
# JSON> uses a sweep's result instead; K3_KNOBS=gemv_cfg="NxK=config;NxK=cublas" forces one weight
# shape's config at every M (an experiment: kernels/choose._forced); K3_KNOBS=gemv=1 forces the CUDA-core GEMV (tuned config or
# launch.GEMV_DEFAULT) for every shape without an entry at M <= launch.GEMV_MAX_M, K3_KNOBS=gemv=0
# turns every decode GEMM off (cuBLAS everywhere).
GEMV_TABLE: dict[tuple[int, int], dict] = {
    (7168, 1536): {1: "mmas 64/256/1/4/3", 4: "mmas 64/256/1/4/3", 16: "mmas 64/256/1/4/3"},  # o-proj, TP=8
    (2240, 7168): {1: "mmas 64/128/4/4/4", 4: "mmas 64/128/4/4/4", 16: "mmas 64/128/4/4/4"},  # router + latent shard
    (3584, 3584): {1: "mmas 64/128/2/4/4", 4: "mmas 64/128/2/4/4", 16: "mmas 64/128/2/4/4"},  # latent up shard
    # shared gate-up, TP=8: alone cuBLAS (split-K + a reduce kernel) was as fast at M = 1 / 4, but on the
    # side stream beside the routed path the MMA kernel with 96 programs leaves SMs to the one-program
    # router top-k (which ran 4x slower beside cuBLAS's): k3 per layer step at world 1
    # (bench/results/layer_*_tp8_w1_h200_30bb50b_sharedmma.json), us at M = 1 / 4 / 16, cuBLAS -> this:
    # KDA 144.2 / 188.6 / 280.0 -> 133.6 / 178.1 / 278.8, MLA 149.0 / 172.3 / 278.1 -> 140.0 / 167.1 / 277.8
    # (192 programs, "mma 32/128/4/4/6": 136.6 / 180.4 / 279.7 and 143.7 / 168.2 / 275.1)
    (1536, 7168): {1: "mmas 64/128/4/4/4", 4: "mmas 64/128/4/4/4", 16: "mmas 64/128/4/4/4"},
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
    # TP=1 at TP=8 head widths (layer_bench --world 1): the router, latent down and latent up whole.
    # Sweep in bench/results/gemv_w1_h200_331e9a6.json (same rule): 1.09-1.11x, 1.05x at M=1
    # (1.02x at 4 and 16: None), 1.13 / 1.14 / 1.03x
    (896, 7168): {1: "mmas 64/128/8/4/4", 4: "mmas 64/128/8/4/4", 16: "mmas 64/128/8/4/4"},   # router, TP=1
    (3584, 7168): {1: "mmas 64/128/4/4/4", 4: None, 16: None},                                # latent down, TP=1
    (7168, 3584): {1: "mmas 64/256/1/4/3", 4: "mmas 64/256/1/4/3", 16: "mmas 64/256/1/4/3"},  # latent up, TP=1
    # the router and latent down stacked (launch.mma_gemm2, shard_router_latent at TP=1). Sweep in
    # bench/results/gemv_w1_stacked_h200_5f8936e.json: 19.2 / 19.4 / 19.5 us at M = 1 / 4 / 16 (cuBLAS
    # 20.3 / 20.2 / 21.1), where the two alone took 7.4 + 16.2 us
    (4480, 7168): {1: "mmas 64/128/2/4/4", 4: "mmas 64/128/2/4/4", 16: "mmas 64/128/2/4/4"},
}
# Per-card rows over GEMV_TABLE (which was tuned on the H200), merged per M: the rows of the first key
# that is a substring of the GPU's name. K3_KNOBS=gemv_card=<key> forces a key's rows, K3_KNOBS=gemv_card=none
# turns them off; K3_KNOBS gemv_table and K3_KNOBS gemv_cfg take precedence. H100: the in_proj GEMMs at M=1 on
# the CUDA-core GEMV (H100 sweep: bench/results/gemv_tune_h100_b8043ff.json; in the layer:
# bench/results/layer_{kda,mla}_tp8_w1_h100_8321eed_gemvrows.json, us per step launch hidden:
# KDA 142.1 -> 140.1, MLA 143.4 -> 141.5; the same configs on an H200: KDA 114.9 -> 117.9,
# MLA 120.1 -> 120.7, hence not in GEMV_TABLE). At M = 4 the H100 sweep's table changed nothing (177.6 /
# 188.0 -> 177.6 / 188.3), so only M=1 rows. In place, on another H100 (..._h100_680df18_card.json):
# KDA 139.8 -> 138.9, MLA 140.9 -> 139.8.
# The stacked router + latent down (4480 x 7168, TP=1; launch.mma_gemm2 with the GEMV's TWO form) at M=1:
# forced in the layer on an H100 (..._h100_f5fc5d7_rlgemv.json): KDA 138.5 -> 137.0, MLA
# 140.0 -> 138.8 ("gemv 8/512/4/3": 140.7 / 143.8). The shared gate-up on the GEMV there was slower
# (139.7 / 141.4): beside the routed kernels it wants the MMA kernel's programs.
# Then the GEMV's LAZY form (one K sum after the loop, "gemvl"): swept alone at M=1 on an H100
# (bench/results/gemv_lazy_h100_5fec68c.json) it took 0.3-0.6 us less than the plain picks on these four
# shapes; in the layer (..._h100_a8800d9_lazyx.json, 5 rounds) all four at once: KDA 140.0 ->
# 139.0, MLA 140.9 -> 139.5 (the stacked one alone: 139.1 / 140.2).
GEMV_TABLE_BY_CARD: dict[str, dict[tuple[int, int], dict]] = {
    "H100": {(6284, 7168): {1: "gemvl 8/512/4/3"},     # KDA in_proj, TP=8
             (3648, 7168): {1: "gemvl 4/1024/4/3"},    # MLA qkv_a, TP=8
             (4480, 7168): {1: "gemvl 2/1024/4/4"},    # router + latent down stacked, TP=1
             (2304, 1536): {1: "gemvl 2/1024/4/4"}},   # MLA q_b, TP=8
}
_TABLES: dict[str, dict] = {}


@functools.lru_cache(maxsize=None)
def _card_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def card_rows(device) -> dict:
    """GEMV_TABLE_BY_CARD's rows for this CUDA device (K3_KNOBS gemv_card: a key, or "none"); {} if none."""
    forced = knob("gemv_card")
    if forced:
        return GEMV_TABLE_BY_CARD.get(forced, {})
    if getattr(device, "type", None) != "cuda":
        return {}
    name = _card_name(device.index if device.index is not None else torch.cuda.current_device())
    return next((rows for key, rows in GEMV_TABLE_BY_CARD.items() if key in name), {})


@functools.lru_cache(maxsize=None)
def parse_cfg(text):
    """A gemv_bench config name: "gemv BN/BK/warps/stages" (the CUDA-core GEMV, a tuple; "gemvl": its
    LAZY form, a fifth element 1) or
    "mma[s] BN/BK/SPLIT/warps/stages" (the tensor-core split-K kernel, a launch.MmaCfg); None and
    configs already parsed pass through."""
    if text is None or not isinstance(text, str):
        return text
    if text.startswith("mma"):
        from .launch import MmaCfg
        return MmaCfg.parse(text)
    kind, _, vals = text.partition(" ")
    parts = tuple(int(v) for v in vals.split("/"))
    if kind not in ("gemv", "gemvl") or len(parts) != 4:
        raise ValueError(f"not a GEMV config name: {text!r} (want 'gemv[l] BN/BK/warps/stages' or 'mma[s] ...')")
    return parts + (1,) if kind == "gemvl" else parts


def gemv_table_from(path: str) -> dict:
    """The GEMV table of a bench/gemv_bench.py result: per shape and M, the best config where it beat
    cuBLAS."""
    if path not in _TABLES:
        import json
        t: dict = {}
        for r in json.load(open(path))["rows"]:
            t.setdefault((r["N"], r["K"]), {})[r["M"]] = r["best"] if r.get("speedup_vs_cublas", 0) > 1.0 else None
        _TABLES[path] = t
    return _TABLES[path]


@functools.lru_cache(maxsize=8)
def _forced(text: str) -> dict:
    """K3_KNOBS=gemv_cfg="NxK=config;NxK=cublas": the config for a weight shape at every M, over the table
    (a tuning experiment: "cublas" runs torch.mm)."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(";"))):
        shape, _, cfg = item.partition("=")
        n, _, k = shape.partition("x")
        out[(int(n), int(k))] = None if cfg.strip() == "cublas" else cfg.strip()
        parse_cfg(out[(int(n), int(k))])  # a bad name fails here, at the first call
    return out


def gemv_plan(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, rows: int | None = None):
    """The GEMV config for x @ w.t() (into out), or None where cuBLAS runs it. rows: look up the
    table for a weight of that many rows instead of w's (two stacked weights: launch.mma_gemm2)."""
    from .launch import GEMV_DEFAULT, GEMV_MAX_M, MMA_MAX_M
    m = x.shape[0]
    flag = knob("gemv")
    if flag == "0" or not (x.is_cuda and x.dim() == 2 and w.dim() == 2 and 1 <= m <= max(GEMV_MAX_M, MMA_MAX_M)):
        return None
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype or x.stride(1) != 1 or w.stride(1) != 1:
        return None
    if out is not None and (out.dtype != x.dtype or out.stride(-1) != 1):
        return None
    path = knob("gemv_table")
    shape = (rows or w.shape[0], w.shape[1])
    forced = _forced(knob("gemv_cfg"))
    if shape in forced:
        return parse_cfg(forced[shape])
    by_m = (gemv_table_from(path) if path else GEMV_TABLE).get(shape, {})
    if not path:
        by_m = {**by_m, **card_rows(x.device).get(shape, {})}
    fit = [mm for mm in sorted(by_m) if mm >= m]
    if fit:
        return parse_cfg(by_m[fit[0]])
    if rows is not None:
        return None
    return GEMV_DEFAULT if flag not in ("", "0") and m <= GEMV_MAX_M else None


def gemm(op: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.t(): the CuTe skinny GEMM where wanted and possible, else the Triton GEMV where it
    measured faster for this weight shape and M (GEMV_TABLE), else torch.mm."""
    m = x.shape[0]
    if op in CUTE_GEMM_OPS and x.is_cuda and x.dim() == 2 and wanted(op, m):
        key = f"{op} N={w.shape[0]} K={x.shape[1]} M={m}"
        if x.dtype != torch.bfloat16 or w.dtype != x.dtype:
            _note(key, f"dtype {x.dtype} (the CuTe kernels are bf16)")
        else:
            try:
                art, why = _find("gemm", "oproj_gemm", w.shape[0], x.shape[1], m)
                if art is not None:
                    return art.launch_gemm(x.contiguous(), w.contiguous())
                _note(key, why)
            except Exception as e:  # noqa: BLE001 - any loader failure falls back, with the reason
                _note(key, f"loader error: {type(e).__name__}: {e}")
    cfg = gemv_plan(x, w)
    if cfg is not None:
        from .launch import gemv
        return gemv(x, w, cfg=cfg)
    return torch.mm(x, w.t())


_PUSH: dict[tuple, object] = {}


def push_gemm(x: torch.Tensor, w: torch.Tensor, peers, group: str):
    """The CuTe push-epilogue o-proj GEMM (cute/skinny_gemm.SkinnyGemmPushSm90) for this call, or
    None: the op then runs its GEMM + pull all-reduce kernel. Wanted where CUTE_M["oproj_push"]
    says so (no range until measured), or forced by K3_KNOBS=cute_push=1 (K3_KNOBS=cute=1 too); K3_KNOBS=cute_push=0
    or K3_KNOBS=cute=0 turn it off. Every rank of the group must take the same path (a rank waiting for
    flags a peer never pushes would hang), so the first eager call of each shape decides with one
    all-reduce (MIN) over the group whether every rank found and loaded the artifact; the answer
    is memoised. Inside a CUDA graph capture an undecided shape takes the pull path."""
    flag = knob("cute_push")
    m, k = x.shape
    n = w.shape[0]
    if flag == "0" or peers is None or peers.world < 2 or peers.flag_off < 0 or not x.is_cuda:
        return None
    if flag != "1" and not wanted("oproj_push", m):
        return None
    key = (group, n, k, m, x.dtype, w.dtype)
    if key in _PUSH:
        return _PUSH[key]
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    from .cute.loader import push_n_fits
    art, why = None, ""
    if x.dtype != torch.bfloat16 or w.dtype != x.dtype:
        why = f"dtype {x.dtype} (the CuTe kernels are bf16)"
    elif not push_n_fits(n):
        why = f"N={n}: the push epilogue needs N a multiple of 64, at most 128 tiles"
    elif peers.world * m * n > peers.half(x.dtype):
        why = f"{peers.world} x {m} x {n} partials do not fit one half of the workspace ({peers.nbytes // 2} bytes)"
    else:
        try:
            art, why = _find("gemm", "oproj_push", n, k, m)
            if art is not None:   # load it now: a rank that cannot must say so before any rank pushes
                _load(art, x.device)
        except Exception as e:  # noqa: BLE001 - any loader failure falls back, with the reason
            art, why = None, f"loader error: {type(e).__name__}: {e}"
    ok = _all_ranks(art is not None, group, x.device)
    if art is not None and not ok:
        why = "another rank of the group cannot run it"
    if why:
        _note(f"oproj_push N={n} K={k} M={m}", why)
    _PUSH[key] = art if ok else None
    return _PUSH[key]


def oproj_note() -> str:
    """Which o-proj GEMM the one-shot path will run (for the match report; push_gemm decides per
    shape at the first call, with every rank)."""
    flag, cute = knob("cute_push"), knob("cute")
    if flag == "0" or (flag != "1" and cute == "0"):
        return f"o-proj: cuBLAS GEMM + pull all-reduce kernel (K3_KNOBS={'cute_push' if flag == '0' else 'cute'}=0)"
    if flag == "1" or cute not in ("", "0"):
        return ("o-proj: CuTe push-epilogue GEMM where every rank has its artifact ("
                + ("K3_KNOBS=cute_push=1" if flag == "1" else "K3_KNOBS=cute=1")
                + "; otherwise cuBLAS + pull, choose.fallbacks() says why)")
    lo, hi = CUTE_M.get("oproj_push", (1, 0))
    if lo <= hi:
        return f"o-proj: CuTe push-epilogue GEMM at M in [{lo}, {hi}], cuBLAS + pull all-reduce kernel elsewhere"
    return ("o-proj: cuBLAS GEMM + pull all-reduce kernel (the CuTe push-epilogue GEMM measured no faster; "
            "K3_KNOBS=cute_push=1 turns it on)")


def _load(art, device) -> None:
    """Load an artifact's cubin on `device` now (cuModuleLoadData), instead of at first launch."""
    from .cute.loader import _driver, device_index
    art._function(device_index(device), _driver())


def _all_ranks(ok: bool, group: str, device) -> bool:
    """True when `ok` holds on every rank of the group (one all-reduce MIN)."""
    import torch.distributed as dist
    t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=dist.distributed_c10d._resolve_process_group(group))
    return bool(t.item())


def gemm_add_(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out += x @ w.t() in place (out may be a column slice): the Triton GEMV where GEMV_TABLE says
    so, else addmm_."""
    cfg = gemv_plan(x, w, out)
    if cfg is not None:
        from .launch import gemv
        return gemv(x, w, out=out, accumulate=True, cfg=cfg)
    return out.addmm_(x, w.t())


def mxfp4_experts_cute(x, topk_ids, w13, w13_scale, w2, w2_scale, beta, linear_beta, math: str = "f32"):
    """The MXFP4 routed experts through the CuTe artifacts of `math` ("f32" | "f16x2";
    launch.mxfp4_experts(variant="cute" | "cute_h2")), or None (the caller falls back to Triton)
    with the reason in fallbacks()."""
    N, K = topk_ids.shape
    L, I = x.shape[1], w13.shape[1] // 2
    forced = (knob("cute_mxfp4_tag") or None)   # benchmarks: a variant of build.MXFP4_TAGS, "none": untagged
    tag = forced if forced is not None else (mxfp4_tag(I, N) if math == "f16x2" else "")
    tag = "" if tag == "none" else tag
    key = f"mxfp4_experts I={I} L={L} K={K}" + ("" if math == "f32" else f" {math}") + (f" {tag}" if tag else "")
    if not x.is_cuda:
        _note(key, "not CUDA (the CuTe kernels are sm_90a cubins)")
        return None
    if x.dtype != torch.bfloat16:
        _note(key, f"dtype {x.dtype} (the CuTe MXFP4 kernels take bf16 activations)")
        return None
    try:
        from .cute import loader
        arts, why = _find("mxfp4", I, L, K, math, tag)
        if arts is None and tag and forced is None:
            # dispatch's variant is not there (an artifact directory built before it, no DSL to
            # build it): the untagged kernels of the same math, with the reason recorded
            arts = _find("mxfp4", I, L, K, math, "")[0]
            if arts is not None:
                _note(key, why, "running the untagged CuTe kernels")
        if arts is None:
            _note(key, why)
            return None
        return loader.mxfp4_experts(*arts, x.contiguous(), topk_ids, w13, w13_scale, w2, w2_scale,
                                    float(beta), float(linear_beta), pdl=cute_pdl())
    except Exception as e:  # noqa: BLE001 - any loader failure falls back, with the reason
        _note(key, f"loader error: {type(e).__name__}: {e}")
        return None


def experts_note(I: int, L: int, K: int, M: int | None, bf16: bool) -> str:
    """Which MXFP4 expert kernel a graph's routed experts will run, and why not CuTe (for the
    match report, at compile time: launch.default_mxfp4_variant, the rule applied at run time)."""
    from .launch import _triton_mxfp4, default_mxfp4_variant
    forced = knob("mxfp4")
    if forced:
        return f"MXFP4 experts: {forced} (K3_KNOBS mxfp4)"
    lo, hi = CUTE_M.get("mxfp4_experts", (1, 0))
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
        arts, why = _find("mxfp4", I, L, K, "f16x2", jit=False)
        jit = arts is None and not _jit_variants("mxfp4", (I, L, K, "f16x2"))[1]
    except Exception as e:  # noqa: BLE001 - a broken artifact directory is a reason, not a crash
        arts, why, jit = None, f"loader error: {type(e).__name__}: {e}", False
    if arts is None and not jit:
        return f"MXFP4 experts: Triton {_triton_mxfp4(M)} ({why})"
    where = "" if M is not None else f" at M in [{lo}, {hi}], Triton v4g above (M is dynamic)"
    how = "built just in time on the first call into " if jit else ""
    return f"MXFP4 experts: CuTe f16x2 GEMVs{where} ({how}{_artifact_dir()})"
