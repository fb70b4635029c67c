"""Backend options: one place for every switch (like AutoDeploy's transform config).

Options come from `k3compile.backend(**options)` / `torch.compile(..., options={...})`, then the
environment: K3_PASSES=a,b (only these), K3_SKIP=a,b, K3_STRICT=1, K3_MODE=inductor|eager.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

PASS_ORDER = (
    "shard_router_latent",
    "fold_moe_finalize",
    "fuse_oproj_allreduce",
    "overlap_shared_expert",  # last: it also fills the prefetch lists of the fused ops
)
# Batch (M = tokens per step) ranges where each pass pays, [lo, hi] inclusive, from the per-op
# benchmark (bench/ops_bench.py on 2 x H200, bench/results/ops_bench_h200x2.json): the fused
# o-proj and the latent tail beat the best of eager and Inductor at every measured M (1..256);
# the sharded router only up to M=16 (equal at 64, slower at 256). Outside its range a pass is
# skipped when M is static; in a dynamic-M graph the ops switch by M at run time
# (kernels/cuda.py ONESHOT_M) to their NCCL paths (the router: the replicated GEMMs).
DEFAULT_M_RANGES = {p: (1, 1 << 30) for p in PASS_ORDER}
DEFAULT_M_RANGES.update(shard_router_latent=(1, 16))

# Where each pass made a whole decoder layer faster than Inductor on the GPU: the per-layer
# benchmark (bench/layer_bench.py, 2 x H200, KDA and MLA layers with LatentMoE at real K3 widths,
# TP=8 per-rank shapes; BENCHMARKS.md "Per layer", bench/results/layer_*_h200x2.json) measured
# every pass on its own as slower than the same graph without K3 passes, at M=1 (KDA, MLA) and M=16
# (KDA) (us added per layer step, KDA / MLA at M=1): shard_router_latent +1.3 / +9.7,
# fold_moe_finalize +11.0 / +3.5, fuse_oproj_allreduce +14.9 / +18.8, overlap_shared_expert +29.1 /
# +27.7 (at TP=2 shapes the router alone was 4-10 us faster; TP=8 is the production case); with all four the layer
# was 0.86-1.00x of Inductor at M=1..256. So with gate="measured" (the default) a CUDA graph compiled
# by Inductor gets no pass outside these ranges, none of which exists yet: k3 is then Inductor plus
# its canonicalisation (measured equal: 271.0 vs 271.9 us). The fused ops themselves are faster in
# isolation (bench/ops_bench.py). Why it did not carry over was found after that run: the graphs still
# ran the replaced GEMMs and all-reduces beside the fused ops (fixed in the pass manager); the fixed
# passes are not measured yet, so this table stays empty until the per-layer benchmark is re-run.
# gate="off" (or K3_GATE=off) applies the passes in their DEFAULT_M_RANGES anyway; CPU graphs and
# mode="eager" are never gated.
CUDA_PROFITABLE_M: dict[str, tuple[int, int]] = {}


@dataclass(frozen=True)
class K3Options:
    passes: tuple[str, ...] = PASS_ORDER
    strict: bool = False
    mode: str = "inductor"  # "inductor": Inductor codegen; "eager": run the rewritten graph op by op
    dtypes: tuple[str, ...] = ("bfloat16",)  # model dtypes the fused ops accept
    tp_sizes: tuple[int, ...] = (1, 2, 4, 8)
    m_ranges: dict = field(default_factory=lambda: dict(DEFAULT_M_RANGES))
    gate: str = "measured"  # "measured": on CUDA + Inductor apply a pass only in CUDA_PROFITABLE_M; "off"
    prefetch: bool = True
    prefetch_bytes: int = 40 << 20  # L2 budget per prefetch (H200 L2 is about 50-60 MB)
    # dynamic=True turns float module attributes (eps, SiTU betas) into graph inputs; bake them back
    # in as constants, guarded at run time (a changed value runs the graph without the K3 passes)
    bake_module_floats: bool = True
    verbose: bool = False  # print the match report after each compile

    @classmethod
    def make(cls, **kw) -> "K3Options":
        env = os.environ
        if "passes" not in kw and env.get("K3_PASSES"):
            kw["passes"] = tuple(p for p in env["K3_PASSES"].split(",") if p)
        skip = kw.pop("skip", None) or tuple(p for p in env.get("K3_SKIP", "").split(",") if p)
        if "strict" not in kw and env.get("K3_STRICT"):
            kw["strict"] = env["K3_STRICT"] not in ("0", "")
        if "mode" not in kw and env.get("K3_MODE"):
            kw["mode"] = env["K3_MODE"]
        unknown = set(kw) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown k3 backend option(s) {sorted(unknown)}; valid: "
                             f"{sorted(f.name for f in dataclasses.fields(cls))} and 'skip'")
        passes = tuple(kw.get("passes", PASS_ORDER))
        bad = [p for p in (*passes, *skip) if p not in PASS_ORDER]
        if bad:
            raise ValueError(f"unknown pass(es) {bad}; valid passes: {list(PASS_ORDER)}")
        kw["passes"] = tuple(p for p in PASS_ORDER if p in passes and p not in skip)
        if "dtypes" in kw:
            kw["dtypes"] = tuple(str(d).replace("torch.", "") for d in kw["dtypes"])
        if kw.get("mode", "inductor") not in ("inductor", "eager"):
            raise ValueError(f"mode must be 'inductor' or 'eager', got {kw['mode']!r}")
        if os.environ.get("K3_GATE") and "gate" not in kw:
            kw["gate"] = os.environ["K3_GATE"]
        if kw.get("gate", "measured") not in ("measured", "off"):
            raise ValueError(f"gate must be 'measured' or 'off', got {kw['gate']!r}")
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
