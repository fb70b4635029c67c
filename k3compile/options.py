"""Backend options: one place for every switch (like AutoDeploy's transform config).

Options come from `k3compile.backend(**options)` / `torch.compile(..., options={...})`, then the
environment: K3_PASSES=a,b (only these), K3_SKIP=a,b, K3_STRICT=1, K3_MODE=inductor|eager,
K3_GATE=measured|off, K3_UNGATED=a,b (these passes past the gate: A/B runs of one pass), K3_PDL=auto|on|off,
K3_PIN_FORK=0|1.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

PASS_ORDER = (
    "shard_router_latent",
    "fuse_router_topk",       # after shard_router_latent: the logits may be its all-gathered ones
    "fold_moe_finalize",
    "fuse_oproj_allreduce",
    "fuse_residual_norm",     # after fuse_oproj_allreduce: the mixers that pass leaves
    "fold_kda_gate",
    "fold_kda_conv",          # after fold_kda_gate: it finds the conv from the core's v either way
    "fold_kda_fb",            # after fold_kda_gate: it folds the gate's f_b GEMV into that pass's op
    "fold_kda_step",          # after fold_kda_conv and fold_kda_fb: their two ops into one
    "fold_kda_onorm",         # after fold_kda_step: the output norm into its op
    "fold_mla_prologue",
    "overlap_shared_expert",  # it also fills the prefetch lists of the fused ops
    "lower_decode_gemm",      # the GEMMs every other pass left (overlap_shared_expert matches mm)
    "fold_mla_output",        # after lower_decode_gemm and fold_mla_prologue: it takes their ops
)
# Batch (M = tokens per step) ranges where each pass pays, [lo, hi] inclusive, from the per-op
# benchmark (bench/ops_bench.py on 2 x H200, bench/results/ops_bench_h200x2.json): the fused
# o-proj and the latent tail beat the best of eager and Inductor at every measured M (1..256);
# the sharded router only up to M=16 (equal at 64, slower at 256). Outside its range a pass is
# skipped when M is static; in a dynamic-M graph the ops switch by M at run time
# (kernels/cuda.py ONESHOT_M) to their NCCL paths (the router: the replicated GEMMs).
DEFAULT_M_RANGES = {p: (1, 1 << 30) for p in PASS_ORDER}
DEFAULT_M_RANGES.update(shard_router_latent=(1, 16), lower_decode_gemm=(1, 16),  # the latter: one MMA tile
                        fold_mla_output=(1, 16))

# Where each pass made a whole decoder layer faster than Inductor on the GPU, [lo, hi] inclusive:
# the per-layer benchmark (bench/layer_bench.py on 2 x H200, KDA and MLA layers with LatentMoE at
# real K3 widths, TP=8 per-rank shapes, commit b906be6; BENCHMARKS.md "Per layer",
# bench/results/layer_*_tp8_h200x2.json). Each pass alone, us per layer step against the same graph
# without K3 passes (KDA / MLA; M=1, then M=16): shard_router_latent -6.1 / +1.3, -5.4 / -9.5;
# fold_moe_finalize -12.1 / -7.4, -20.4 / -22.5; fuse_oproj_allreduce -10.2 / -4.6, -16.9 / -14.8;
# overlap_shared_expert without prefetch (k3-prefetch minus k3-overlap_shared_expert) -0.9 / -7.7,
# -9.1 / -10.0. The L2 prefetch made every layer slower (+0.9 / +10.1 at M=1, +56.9 / +40.4 at
# M=16): it is gated off ("prefetch" below, an option of overlap_shared_expert, not a pass). With
# every pass and prefetch the layer was 0.97-1.05x of Inductor at M=1..256 (1.01x at 64 and 256,
# where no ablation ran), without prefetch 1.04-1.09x at M=1 and 16. The ranges run to 256 where
# the all-pass layer was measured no slower; the router pass stops at 16 (its DEFAULT_M_RANGES).
# With gate="measured" (the default) a CUDA graph compiled by Inductor gets a pass only inside its
# range here. gate="off" (or K3_GATE=off) applies the passes in their DEFAULT_M_RANGES, and prefetch
# if options.prefetch; CPU graphs and mode="eager" are never gated.
CUDA_PROFITABLE_M: dict[str, tuple[int, int]] = {
    "shard_router_latent": (1, 16),
    "fold_moe_finalize": (1, 256),
    "fuse_oproj_allreduce": (1, 256),
    "overlap_shared_expert": (1, 256),
    "prefetch": (1, 0),  # measured slower at every M tried: never applied by the gate
    # KDA layer, TP=8 shapes, M=1 (92e6e28, medians of 3 rounds): -1.6 us with every other pass
    # (k3-prefetch 187.7 vs k3-fold_kda_gate 189.3), -1.3 us alone (k3+fold_kda_gate 217.7 vs k3none
    # 219.0). At M = 64 / 256 (70fb2a7, as fuse_residual_norm below) it cost +4.9 / +52.7 us.
    # M = 4 and 16 since 2026-12-04 (301a32c, ONE H200, TP=8 widths, bench/results/
    # layer_kda_tp8_w1_h200_301a32c_fb.json, launch hidden, medians of 3 rounds): with fold_kda_conv and
    # fold_kda_fb, against the layer without the three, 157.6 -> 148.3 us at M=4, 258.9 -> 251.0 at M=16
    "fold_kda_gate": (1, 16),
    # KDA layer, TP=8 per-rank widths on ONE H200 (world 1: no communication; the pass only changes
    # GEMMs), 3dba9ee, medians of 3 rounds: every pass vs every pass but this one (k3-prefetch vs
    # k3-lower_decode_gemm) -6.2 / -14.3 / -19.1 us at M = 1 / 4 / 16; alone vs no pass -4.6 / -10.3 /
    # -10.8 us (bench/results/layer_kda_tp8_w1_h200_3dba9ee.json)
    "lower_decode_gemm": (1, 16),
    # KDA and MLA layers at TP=8 per-rank widths on ONE H200 (world 1: the op's kernel without its
    # all-reduce), c31c5e5, medians of 3 rounds: every pass vs every pass but this one (k3-prefetch vs
    # k3-fuse_residual_norm) KDA -5.6 / -2.6 us at M = 1 / 4 (M=16 cut by the step's time limit),
    # MLA -6.7 / -1.3 / -2.0 us at M = 1 / 4 / 16 (bench/results/layer_*_tp8_w1_h200_c31c5e5*); with
    # the gate applying it, 3d59b9d: KDA -0.5 / -7.2 / -5.4, MLA -3.6 / -13.6 / -3.0 us; alone within
    # the runs' noise (-9.1 to +6.9 us). No two-GPU run yet (its all-reduce is the o-proj op's kernel).
    # M = 64 / 256 (70fb2a7, `--ablate 64,256`, bench/results/layer_{kda,mla}_tp8_w1_h200_70fb2a7_ablate.json),
    # every pass vs every pass but this one: KDA -9.8 / -12.0 us, MLA -15.8 / -15.8 us
    "fuse_residual_norm": (1, 256),
    # the router's selection in one kernel: part of shard_router_latent (TP > 1, M = 1..16) until
    # 2026-12-02, its own pass since, so that TP=1 graphs get it too. Op alone, 2 x H200 (6eecf90,
    # bench/router_bench.py): 5.4 us vs Inductor's 17.9-20.6 us at M = 1..64; the layer rows:
    # BENCHMARKS.md, seventeenth session.
    # M = 64 / 256 (70fb2a7, `--ablate 64,256`, bench/results/layer_{kda,mla}_tp8_w1_h200_70fb2a7_ablate.json),
    # every pass vs every pass but this one: KDA -29.8 / -23.5 us, MLA -26.3 / -22.5 us
    "fuse_router_topk": (1, 256),
    # the KDA short conv in one kernel. KDA layer at TP=8 widths on ONE H200, 02711a2
    # (bench/results/layer_kda_tp8_w1_h200_02711a2_conv.json), medians of 3 rounds, every pass vs every
    # pass but this one: -3.4 / +1.2 / +0.2 us at M = 1 / 4 / 16 (kernels 26 -> 22 at M=1); alone
    # (no fold_kda_gate: the normalisations then read its output) +0.9 / +4.9 / +3.3 us. So M=1, as
    # fold_kda_gate, whose raw q / k inputs it produces (with it, at M = 64 / 256, 70fb2a7: -7.2 / +4.8 us).
    # M = 4 and 16 with fold_kda_gate and fold_kda_fb since 2026-12-04 (301a32c: see fold_kda_gate)
    "fold_kda_conv": (1, 16),
    # the f_b GEMV folded into the recurrence (one Triton kernel). 301a32c, same run as fold_kda_gate's
    # M = 4 / 16 figures: at M=1 (gate and conv on in both) 118.3 -> 116.1 us (kernels 17 -> 16); at
    # M = 4 / 16 only measured with gate + conv (-9.3 / -7.8 us for the three together)
    "fold_kda_fb": (1, 16),
    # fold_kda_conv's and fold_kda_fb's ops in one kernel (4 programs per head). 301a32c, same run,
    # against gate + conv + fb: M = 1 / 4 / 16: -0.03 / -2.7 / -0.0 us (kernels 16 -> 15); a96ee5a
    # (bench/results/layer_kda_tp8_w1_h200_a96ee5a_onorm.json) at M=16: +1.8 alone, but with
    # fold_kda_onorm (which needs it) -2.5 against the default then (251.9 -> 249.4). So 1..16, with it
    "fold_kda_step": (1, 16),
    # the KDA output norm in the step kernel (one launch fewer). a96ee5a, KDA layer at TP=8 widths on ONE
    # H200, launch hidden, medians of 3 rounds (every round lower), against the default (step at 1 / 4):
    # -0.8 / -1.8 us at M = 1 / 4 (116.1 -> 115.3, 146.1 -> 144.3; kernels 15 -> 14); at 16 with step
    # -2.5 (above)
    "fold_kda_onorm": (1, 16),
    # The three MLA folds. MLA layer at TP=8 widths on ONE H200, medians of 3 rounds, every pass vs every
    # pass but this one, us at M = 1 / 4 / 16 (bench/results/layer_mla_tp8_w1_h200_*):
    # the kv_a norm + cat in the attention kernel, the q_rope copy dropped: -9.2 / -2.7 / -5.5 (b4de30d),
    # -4.7 / -5.0 / -6.1 (ad84e26); 3 kernels fewer.
    # M = 64 / 256 (70fb2a7, `--ablate 64,256`, bench/results/layer_{kda,mla}_tp8_w1_h200_70fb2a7_ablate.json),
    # every pass vs every pass but this one: -7.6 / -5.6 us
    "fold_mla_prologue": (1, 256),
    # the split combine + value up-projection (+ gate) in one kernel: -1.3 / -1.6 / -8.0 (ad84e26; the
    # kernel 5.5 us where the combine and head_bmm took 3.1 + 3.3)
    "fold_mla_output": (1, 16),
}
# passes with no per-layer GPU run yet: the gate's reason says so (fold_kda_fb and fold_kda_step were
# here from 2026-12-03 until their first GPU run, 2026-12-04: bench/gpu_session.sh kdafb).
# fold_kda_onorm only until its run the same day (bench/gpu_session.sh onorm)
CUDA_UNMEASURED: set[str] = set()


@dataclass(frozen=True)
class K3Options:
    passes: tuple[str, ...] = PASS_ORDER
    strict: bool = False
    mode: str = "inductor"  # "inductor": Inductor codegen; "eager": run the rewritten graph op by op
    dtypes: tuple[str, ...] = ("bfloat16",)  # model dtypes the fused ops accept
    tp_sizes: tuple[int, ...] = (1, 2, 4, 8)
    m_ranges: dict = field(default_factory=lambda: dict(DEFAULT_M_RANGES))
    gate: str = "measured"  # "measured": on CUDA + Inductor apply a pass only in CUDA_PROFITABLE_M; "off"
    ungated: tuple[str, ...] = ()  # passes (or "prefetch") the measured gate lets through at every M (K3_UNGATED)
    prefetch: bool = True
    prefetch_bytes: int = 40 << 20  # L2 budget per prefetch (H200 L2 is about 50-60 MB)
    # dynamic=True turns float module attributes (eps, SiTU betas) into graph inputs; bake them back
    # in as constants, guarded at run time (a changed value runs the graph without the K3 passes)
    bake_module_floats: bool = True
    # Programmatic Dependent Launch in Inductor's Triton kernels (config triton.enable_pdl): "auto" turns
    # it on for CUDA graphs on Hopper or newer where this torch has the option; "on" / "off" force it
    # (K3_PDL). Measured on 2 x H200 (BENCHMARKS.md "Inductor's Programmatic Dependent Launch", commit 6eecf90): k3 4.2-14.9 us faster per
    # layer step (KDA / MLA, TP=8 shapes, M=1 and 16), errors unchanged; plain Inductor gained at
    # most 6.2 us and lost up to 8.7 with it
    pdl: str = "auto"
    # overlap_shared_expert pins the side-stream fork between the router GEMM and its top-k (ordering-only
    # arguments); False leaves it right after the MoE input, where Inductor's scheduler picks its
    # neighbour (K3_PIN_FORK=0; kept to measure the pin against)
    pin_shared_fork: bool = True
    verbose: bool = False  # print the match report after each compile

    @classmethod
    def make(cls, **kw) -> "K3Options":
        """Options from keywords, then the environment. A sequence option (passes, skip, dtypes,
        tp_sizes, ungated) takes one value or a list of them: `skip="fuse_oproj_allreduce"` is one
        pass, `dtypes=torch.float32` one dtype. Unknown names raise ValueError listing the valid ones."""
        env = os.environ
        if "passes" not in kw and env.get("K3_PASSES"):
            kw["passes"] = tuple(p for p in env["K3_PASSES"].split(",") if p)
        skip = _seq(kw.pop("skip", None)) or tuple(p for p in env.get("K3_SKIP", "").split(",") if p)
        if "strict" not in kw and env.get("K3_STRICT"):
            kw["strict"] = env["K3_STRICT"] not in ("0", "")
        if "mode" not in kw and env.get("K3_MODE"):
            kw["mode"] = env["K3_MODE"]
        unknown = set(kw) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown k3 backend option(s) {sorted(unknown)}; valid: "
                             f"{sorted(f.name for f in dataclasses.fields(cls))} and 'skip'")
        passes = _seq(kw.get("passes", PASS_ORDER))
        bad = [p for p in (*passes, *skip) if p not in PASS_ORDER]
        if bad:
            raise ValueError(f"unknown pass(es) {bad}; valid passes: {list(PASS_ORDER)}")
        kw["passes"] = tuple(p for p in PASS_ORDER if p in passes and p not in skip)
        if "dtypes" in kw:
            kw["dtypes"] = tuple(_dtype_name(d) for d in _seq(kw["dtypes"]))
        if "tp_sizes" in kw:
            kw["tp_sizes"] = _seq(kw["tp_sizes"])
            bad = [t for t in kw["tp_sizes"] if isinstance(t, bool) or not isinstance(t, int) or t < 1]
            if bad:
                raise ValueError(f"tp_sizes must be positive ints (e.g. tp_sizes=(1, 2, 4, 8)), got {bad}")
        if kw.get("mode", "inductor") not in ("inductor", "eager"):
            raise ValueError(f"mode must be 'inductor' or 'eager', got {kw['mode']!r}")
        if os.environ.get("K3_GATE") and "gate" not in kw:
            kw["gate"] = os.environ["K3_GATE"]
        if "ungated" not in kw and env.get("K3_UNGATED"):
            kw["ungated"] = tuple(p for p in env["K3_UNGATED"].split(",") if p)
        kw["ungated"] = _seq(kw.get("ungated", ()))
        bad = [p for p in kw["ungated"] if p not in (*PASS_ORDER, "prefetch")]
        if bad:
            raise ValueError(f"unknown pass(es) {bad} in ungated; valid: {list(PASS_ORDER)} and 'prefetch'")
        if kw.get("gate", "measured") not in ("measured", "off"):
            raise ValueError(f"gate must be 'measured' or 'off', got {kw['gate']!r}")
        if env.get("K3_PIN_FORK") and "pin_shared_fork" not in kw:
            kw["pin_shared_fork"] = env["K3_PIN_FORK"] not in ("0", "")
        if os.environ.get("K3_PDL") and "pdl" not in kw:
            kw["pdl"] = os.environ["K3_PDL"]
        if kw.get("pdl", "auto") not in ("auto", "on", "off"):
            raise ValueError(f"pdl must be 'auto', 'on' or 'off', got {kw['pdl']!r}")
        m_ranges = dict(DEFAULT_M_RANGES)
        m_ranges.update(kw.get("m_ranges", {}))
        kw["m_ranges"] = m_ranges
        return cls(**kw)

    def key(self) -> str:
        """Stable text of everything that changes what the passes emit (for the FX graph cache)."""
        d = dataclasses.asdict(self)
        d.pop("verbose")
        d["m_ranges"] = {k: list(v) for k, v in sorted(self.m_ranges.items())}
        return json.dumps(d, sort_keys=True)


# the float dtypes a graph's activations can have, by torch's name (an alias such as "half" or a
# torch.dtype is taken as its name)
FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")


def _seq(v) -> tuple:
    """One value (a name, a dtype, an int) or a sequence of them, as a tuple. A bare string is one
    name, never its characters."""
    if v is None:
        return ()
    if isinstance(v, (str, int)) or type(v).__name__ == "dtype":
        return (v,)
    return tuple(v)


def _dtype_name(d) -> str:
    import torch
    t = d if isinstance(d, torch.dtype) else getattr(torch, d, None) if isinstance(d, str) else None
    name = str(t).replace("torch.", "") if isinstance(t, torch.dtype) else None
    if name not in FLOAT_DTYPES:
        raise ValueError(f"unknown dtype {d!r} in dtypes; valid: {list(FLOAT_DTYPES)} (names or torch dtypes)")
    return name
