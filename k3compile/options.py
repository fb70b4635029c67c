"""Backend options (like AutoDeploy's transform config).

Options come from `k3compile.backend(**options)` / `torch.compile(..., options={...})`, then the
user switches of the environment (config.SWITCHES): K3_PASSES=a,b (only these), K3_SKIP=a,b,
K3_STRICT=1, K3_MODE=inductor|eager, K3_GATE=measured|off, K3_UNGATED=a,b (these passes past the
gate: A/B runs of one pass), K3_PDL=auto|on|off; and the knob pin_fork (K3_KNOBS=pin_fork=0).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from .config import env, knob

# the pass table (passes/pipeline.py) is the only list of passes, their batch ranges and CUDA gate
from .passes.pipeline import CUDA_PROFITABLE_M, CUDA_UNMEASURED, DEFAULT_M_RANGES, PASS_ORDER  # noqa: E402,F401


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
    # (K3_PDL). Measured on 2 x H200 (BENCHMARKS.md "Inductor's Programmatic Dependent Launch"): k3 4.2-14.9 us faster per
    # layer step (KDA / MLA, TP=8 shapes, M=1 and 16), errors unchanged; plain Inductor gained at
    # most 6.2 us and lost up to 8.7 with it
    pdl: str = "auto"
    # overlap_shared_expert pins the side-stream fork between the router GEMM and its top-k (ordering-only
    # arguments); False leaves it right after the MoE input, where Inductor's scheduler picks its
    # neighbour (K3_KNOBS=pin_fork=0; kept to measure the pin against)
    pin_shared_fork: bool = True
    verbose: bool = False  # print the match report after each compile

    @classmethod
    def make(cls, **kw) -> "K3Options":
        """Options from keywords, then the environment. A sequence option (passes, skip, dtypes,
        tp_sizes, ungated) takes one value or a list of them: `skip="fuse_oproj_allreduce"` is one
        pass, `dtypes=torch.float32` one dtype. Unknown names raise ValueError listing the valid ones."""
        if "passes" not in kw and env("K3_PASSES"):
            kw["passes"] = tuple(p for p in env("K3_PASSES").split(",") if p)
        skip = _seq(kw.pop("skip", None)) or tuple(p for p in env("K3_SKIP").split(",") if p)
        if "strict" not in kw and env("K3_STRICT"):
            kw["strict"] = env("K3_STRICT") != "0"
        if "mode" not in kw and env("K3_MODE"):
            kw["mode"] = env("K3_MODE")
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
        if env("K3_GATE") and "gate" not in kw:
            kw["gate"] = env("K3_GATE")
        if "ungated" not in kw and env("K3_UNGATED"):
            kw["ungated"] = tuple(p for p in env("K3_UNGATED").split(",") if p)
        kw["ungated"] = _seq(kw.get("ungated", ()))
        bad = [p for p in kw["ungated"] if p not in (*PASS_ORDER, "prefetch")]
        if bad:
            raise ValueError(f"unknown pass(es) {bad} in ungated; valid: {list(PASS_ORDER)} and 'prefetch'")
        if kw.get("gate", "measured") not in ("measured", "off"):
            raise ValueError(f"gate must be 'measured' or 'off', got {kw['gate']!r}")
        if knob("pin_fork") and "pin_shared_fork" not in kw:
            kw["pin_shared_fork"] = knob("pin_fork") != "0"
        if env("K3_PDL") and "pdl" not in kw:
            kw["pdl"] = env("K3_PDL")
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
