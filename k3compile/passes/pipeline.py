"""The pipeline table: the only list of K3 passes, in the order they run.

One row per pass: its name (also its module, `passes/<name>.py`), the passes whose ops it anchors on
(`needs`), the batch range it runs in at all (`m_range`, tokens per step, inclusive), the batch range
where the CUDA gate lets it run under Inductor (`cuda_m`; `(1, 0)`: at no M) and the evidence for
that gate: a result file under bench/results/ (the per-layer benchmark, bench/layer_bench.py, at
TP=8 per-rank widths) and what it showed. A pass registers its class with `@register` in its own
module; the manager imports the module of every row, so a row without a registered pass, or a
registered pass without a row, is an error (never a pass quietly off).

`FEATURES` holds the gated parts of passes that are not passes themselves (the L2 prefetch of
overlap_shared_expert, the CuTe push-epilogue GEMM of the o-proj op), with the same CUDA gate.

The gate (base.gated_off) applies on CUDA with mode="inductor" and gate="measured" (the default);
gate="off" (K3_GATE=off) or `ungated` (K3_UNGATED) let a pass through at every M of its m_range.
CPU graphs and mode="eager" are never gated. A dynamic-M graph gets every pass with a non-empty
range: its ops switch to their unfused paths at run time outside the tuned ranges.
"""
from __future__ import annotations

from dataclasses import dataclass

ALL_M = (1, 1 << 30)
NEVER = (1, 0)
TP_ONLY = "TP > 1 only; not yet measured at TP > 1"


@dataclass(frozen=True)
class Row:
    name: str
    needs: tuple[str, ...] = ()
    m_range: tuple[int, int] = ALL_M   # where the pass runs at all (a static M outside: skipped)
    cuda_m: tuple[int, int] = NEVER    # where the CUDA gate lets it run with Inductor
    evidence: str = ""                 # bench/results/<file>: what it measured (or why there is none)


# KDA / MLA decoder layer at TP=8 per-rank widths; "every pass but this one" against every pass
# (the ablation) unless a row says otherwise; us per layer step, medians of 3 rounds.
PIPELINE: tuple[Row, ...] = (
    Row("shard_router_latent", m_range=(1, 16), cuda_m=(1, 16),
        evidence="bench/results/layer_{kda,mla}_tp8_h200x2_b906be6.json: alone vs no pass, KDA -6.1 / +1.3, "
                 "MLA -5.4 / -9.5 us at M = 1 / 16 (2 x H200)"),
    # after shard_router_latent: the logits may be its all-gathered ones
    Row("fuse_router_topk", cuda_m=(1, 256),
        evidence="bench/results/layer_{kda,mla}_tp8_w1_h200_70fb2a7_ablate.json: KDA -29.8 / -23.5, "
                 "MLA -26.3 / -22.5 us at M = 64 / 256; the op alone 5.4 us vs Inductor's 17.9-20.6 "
                 "(bench/router_bench.py)"),
    # after fuse_router_topk (the ids may be its op's); before fold_moe_finalize (which takes its op)
    Row("lower_mxfp4_experts", cuda_m=NEVER,
        evidence="not measured on the GPU yet (applied on CUDA with gate='off'): models with plain-torch "
                 "experts only"),
    Row("fold_moe_finalize", cuda_m=(1, 256),
        evidence="bench/results/layer_{kda,mla}_tp8_h200x2_b906be6.json: alone vs no pass, KDA -12.1 / -7.4, "
                 "MLA -20.4 / -22.5 us at M = 1 / 16 (2 x H200)"),
    Row("fuse_oproj_allreduce", cuda_m=(1, 256),
        evidence="bench/results/layer_{kda,mla}_tp8_h200x2_b906be6.json: alone vs no pass, KDA -10.2 / -4.6, "
                 "MLA -16.9 / -14.8 us at M = 1 / 16 (2 x H200)"),
    # after fuse_oproj_allreduce: the mixers that pass leaves
    Row("fuse_residual_norm", cuda_m=(1, 256),
        evidence="bench/results/layer_mla_tp8_w1_h200_c31c5e5.json: KDA -5.6 / -2.6 (M = 1 / 4), MLA -6.7 / "
                 "-1.3 / -2.0 us (M = 1 / 4 / 16); layer_{kda,mla}_tp8_w1_h200_70fb2a7_ablate.json: KDA -9.8 / "
                 "-12.0, MLA -15.8 / -15.8 us at M = 64 / 256 (one H200)"),
    Row("fold_kda_gate", cuda_m=(1, 16),
        evidence="bench/results/layer_kda_tp8_w1_h200_301a32c_fb.json: with fold_kda_conv and fold_kda_fb, "
                 "157.6 -> 148.3 us at M=4, 258.9 -> 251.0 at M=16; at M = 64 / 256 +4.9 / +52.7 us "
                 "(layer_kda_tp8_w1_h200_70fb2a7_ablate.json; one H200)"),
    # after fold_kda_gate: it finds the conv from the core's v either way
    Row("fold_kda_conv", cuda_m=(1, 16),
        evidence="bench/results/layer_kda_tp8_w1_h200_02711a2_conv.json: -3.4 / +1.2 / +0.2 us at M = 1 / 4 / "
                 "16, and with fold_kda_gate and fold_kda_fb at 4 / 16 (layer_kda_tp8_w1_h200_301a32c_fb.json)"),
    # after fold_kda_gate: it folds the gate's f_b GEMV into that pass's op
    Row("fold_kda_fb", needs=("fold_kda_gate",), cuda_m=(1, 16),
        evidence="bench/results/layer_kda_tp8_w1_h200_301a32c_fb.json: 118.3 -> 116.1 us at M=1 (gate and "
                 "conv on in both); -9.3 / -7.8 us at M = 4 / 16 for gate + conv + fb together"),
    # after fold_kda_conv and fold_kda_fb: their two ops into one
    Row("fold_kda_step", needs=("fold_kda_conv", "fold_kda_fb"), cuda_m=(1, 16),
        evidence="bench/results/layer_kda_tp8_w1_h200_301a32c_fb.json: -0.03 / -2.7 / -0.0 us at M = 1 / 4 / "
                 "16; with fold_kda_onorm -2.5 us at M=16 (layer_kda_tp8_w1_h200_a96ee5a_onorm.json)"),
    # after fold_kda_step: the output norm into its op
    Row("fold_kda_onorm", needs=("fold_kda_step",), cuda_m=(1, 16),
        evidence="bench/results/layer_kda_tp8_w1_h200_a96ee5a_onorm.json: -0.8 / -1.8 / -2.5 us at "
                 "M = 1 / 4 / 16 (one launch fewer)"),
    Row("fold_mla_prologue", cuda_m=(1, 256),
        evidence="bench/results/layer_mla_tp8_w1_h200_b4de30d_pro.json: -9.2 / -2.7 / -5.5 us at M = 1 / 4 / 16; "
                 "layer_mla_tp8_w1_h200_70fb2a7_ablate.json: -7.6 / -5.6 us at M = 64 / 256"),
    # it also fills the prefetch lists of the fused ops (FEATURES["prefetch"])
    Row("overlap_shared_expert", cuda_m=(1, 256),
        evidence="bench/results/layer_{kda,mla}_tp8_h200x2_b906be6.json: without the prefetch, KDA -0.9 / "
                 "-7.7, MLA -9.1 / -10.0 us at M = 1 / 16 (2 x H200)"),
    # the GEMMs every other pass left (overlap_shared_expert matches mm); M <= 16: one MMA tile
    Row("lower_decode_gemm", m_range=(1, 16), cuda_m=(1, 16),
        evidence="bench/results/layer_kda_tp8_w1_h200_3dba9ee.json: -6.2 / -14.3 / -19.1 us at M = 1 / 4 / 16 "
                 "(one H200)"),
    # after lower_decode_gemm and fold_mla_prologue: it takes their ops
    Row("fold_mla_output", needs=("fold_mla_prologue", "lower_decode_gemm"), m_range=(1, 16), cuda_m=(1, 16),
        evidence="bench/results/layer_mla_tp8_w1_h200_ad84e26_fold.json: -1.3 / -1.6 / -8.0 us at M = 1 / 4 / 16"),
    # last: it pairs the norm ops (fuse_residual_norm, fuse_oproj_allreduce) with the GEMM ops (lower_decode_gemm,
    # shard_router_latent) the passes before it emitted; the GEMV's PDL form runs where the GEMV does (M=1 rows)
    Row("pair_pdl", needs=("lower_decode_gemm",), m_range=(1, 16), cuda_m=(1, 1),
        evidence="bench/results/layer_{kda,mla}_tp8_w1_h100_843c313_pdl1.json: no PDL / the pairs with "
                 "tuning.GEMV_PDL_PF, KDA 139.0 / 132.4, MLA 139.4 / 132.5 us at M=1 (one H100, the GEMVs of its "
                 "card rows); M = 4 / 16 within 0.4 us (MMA GEMMs there, which have no PDL form)"),
)


@dataclass(frozen=True)
class Feature:
    name: str
    part_of: str                       # the pass (or op) it belongs to
    cuda_m: tuple[int, int] = NEVER
    evidence: str = ""


FEATURES: dict[str, Feature] = {f.name: f for f in (
    # the L2 weight prefetch while a communication kernel runs (options.prefetch): only where there is
    # communication. On 2 x H200 with the first kernels it made every layer slower (+0.9 / +10.1 us at M=1,
    # +56.9 / +40.4 at M=16: bench/results/layer_{kda,mla}_tp8_h200x2_b906be6.json), so the gate keeps it off
    Feature("prefetch", "overlap_shared_expert", NEVER, f"{TP_ONLY} (on the current kernels)"),
    # the CuTe push-epilogue o-proj GEMM (kernels/comm.push_gemm; its range: tuning.CUTE_M["oproj_push"])
    Feature("oproj_push", "fuse_oproj_allreduce", NEVER, TP_ONLY),
)}

ROWS: dict[str, Row] = {r.name: r for r in PIPELINE}
PASS_ORDER: tuple[str, ...] = tuple(ROWS)
DEFAULT_M_RANGES: dict[str, tuple[int, int]] = {r.name: r.m_range for r in PIPELINE}
CUDA_PROFITABLE_M: dict[str, tuple[int, int]] = {**{r.name: r.cuda_m for r in PIPELINE},
                                                  **{f.name: f.cuda_m for f in FEATURES.values()}}
# passes with no per-layer GPU run yet: the gate's reason says so
CUDA_UNMEASURED: set[str] = {"lower_mxfp4_experts"}


def _check() -> None:
    for r in PIPELINE:
        for need in r.needs:
            if need not in ROWS or PASS_ORDER.index(need) > PASS_ORDER.index(r.name):
                raise ValueError(f"pipeline row {r.name}: needs {need}, which is not a pass before it")


_check()

REGISTRY: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator of a K3 pass: records it under its name, with its row's `needs`. A pass
    whose name has no row in PIPELINE is an error."""
    row = ROWS.get(cls.name)
    if row is None:
        raise ValueError(f"k3 pass {cls.name!r} has no row in passes/pipeline.py PIPELINE: add one "
                         "(its needs, batch range, CUDA gate and evidence)")
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ValueError(f"k3 pass {cls.name!r} registered twice")
    cls.needs = row.needs
    REGISTRY[cls.name] = cls
    return cls


def passes() -> dict:
    """{name: pass instance} of every row, in the table's order: each row's module (passes/<name>.py)
    imported, its class registered."""
    import importlib
    for name in PASS_ORDER:
        importlib.import_module(f"{__package__}.{name}")
    missing = [n for n in PASS_ORDER if n not in REGISTRY]
    if missing:
        raise ValueError(f"pipeline rows without a registered pass (@register in passes/<name>.py): {missing}")
    return {name: REGISTRY[name]() for name in PASS_ORDER}
