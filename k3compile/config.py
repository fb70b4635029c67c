"""The one reader of the environment in k3compile.

Two kinds of setting come from it:

- **User switches** (`SWITCHES`): ten `K3_*` variables a user sets, each documented below and in
  README. The backend options (`options.K3Options`) read theirs when they are made; a switch never
  changes what a compiled graph does without a new compile.
- **Experiment knobs** (`Knobs`): settings for benchmarks and A/B runs of kernels and rewrites, all
  in one variable, `K3_KNOBS="name=value,name=value"` (a piece without "=" continues the value
  before it: `attention_ops=my::attn,my::attn2`). Unknown names raise. Every knob is read where it
  is used, at each call, so a benchmark can change it between compiles; the pass manager puts all
  of them in Inductor's cache key (`Knobs.key`), so a changed knob never reuses a cached graph.
  An empty value means the built-in default, which the code that reads the knob documents (with
  the measurement behind it).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

SWITCHES: dict[str, str] = {
    "K3_PASSES": "comma-separated passes to run (only these); default: every pass of passes/pipeline.py",
    "K3_SKIP": "comma-separated passes not to run",
    "K3_STRICT": "1: a pass that fails, or an expected site that does not match, is an error (not a warning)",
    "K3_MODE": "inductor (default): Inductor compiles the rewritten graph; eager: run it op by op",
    "K3_GATE": "measured (default): on CUDA a pass runs only at the M where it measured faster; off: everywhere",
    "K3_UNGATED": "comma-separated passes (or 'prefetch') the measured gate lets through at every M",
    "K3_PDL": "auto (default) / on / off: Programmatic Dependent Launch in Inductor's Triton kernels",
    "K3_KERNELS": "0: every k3 op runs its PyTorch reference (no CUDA kernel)",
    "K3_SYMM_BYTES": "bytes of the symmetric-memory workspace per TP group (default 16 MiB)",
    "K3_CUTE_DIR": "directory of CuTe kernel artifacts looked in before the packaged ones (default ~/.cache/k3compile/cute)",
}
KNOBS_VAR = "K3_KNOBS"


def env(name: str) -> str:
    """The value of user switch `name` ("" when unset)."""
    if name not in SWITCHES:
        raise KeyError(f"{name} is not a k3compile switch; switches: {sorted(SWITCHES)} (experiment knobs: "
                       f"{KNOBS_VAR}, config.Knobs)")
    return os.environ.get(name, "")


@dataclass(frozen=True)
class Knobs:
    """Experiment knobs (K3_KNOBS). Each is a string; "" is the default of the code that reads it."""
    # rewriting (patterns, passes)
    attention_ops: str = ""   # extra attention-core op names (comma-separated) for role discovery
    expert_ops: str = ""      # extra routed-expert op names (comma-separated)
    conv_inplace: str = ""    # 0: fold_kda_conv emits the functional conv op (default: in place)
    pin_fork: str = ""        # 0: overlap_shared_expert does not pin the side-stream fork (options.pin_shared_fork)
    # communication kernels (kernels/comm.py documents each; kernels/tuning.py the measured defaults)
    barrier_seq: str = ""     # 0: the CAS-handshake barrier instead of sequence flags
    ar_warps: str = ""        # warps of the all-reduce / norm kernel (default: by width)
    comm_early: str = ""      # 0: the peer-independent reads after the barrier wait
    comm_vec: str = ""        # 0: peers signalled and polled one after another
    ar_preload: str = ""      # 0: each AttnRes block row loaded just before its reduction
    ar_lean: str = ""         # 1 / 0: the lean all-reduce / norm form always / never (default: by group size)
    ar_joint: str = ""        # 1 / 0: the joint AttnRes reductions always / never (default: by group size)
    cols: str = ""            # 1 / 0: the column-split norm kernels at any group size / never
    cols_max_m: str = ""      # the most rows the column-split kernels take
    cols_w: str = ""          # columns per program of the column-split kernels
    # decode GEMMs
    gemv: str = ""            # 1 / 0: the Triton decode GEMMs forced on / off (default: the tuned table)
    gemv_table: str = ""      # a bench/gemv_bench.py JSON used as the tuned table
    gemv_cfg: str = ""        # "NxK=config;NxK=cublas": one weight shape's config at every M
    gemv_card: str = ""       # a GEMV_TABLE_BY_CARD key forced, or "none"
    gemv_pdl: str = ""        # on / off / bytes: the GEMV after the TP=1 norm as its PDL secondary (default on)
    gemv_pdl_pf: str = ""     # "NxK=bytes;...": the GEMV PDL prefetch table
    decode_bmm: str = ""      # 0: k3::decode_bmm runs torch.bmm
    # router, MoE, CuTe
    router_sort: str = ""     # 0: the router top-k by max-reduction rounds (default: bitonic sort)
    mxfp4: str = ""           # an MXFP4 expert kernel variant forced (v2b, v3, v3g, v4g, cute)
    cute: str = ""            # 1 / 0: the CuTe kernels at every M / never (default: their measured ranges)
    cute_push: str = ""       # 1 / 0: the CuTe push-epilogue o-proj GEMM forced on / off
    cute_jit: str = ""        # 0: no JIT build of a missing CuTe artifact
    cute_probe: str = ""      # 1: the loader serves probe artifacts (wrong results; benchmarks only)
    cute_mxfp4_tag: str = ""  # a CuTe MXFP4 build tag forced ("none": untagged)
    cute_pdl: str = ""        # 0: the CuTe MXFP4 down kernel without PDL
    # attention
    mla_triton: str = ""      # 0: the model's MLA decode keeps its reference (no Triton kernel registered)
    mla_uv_bv: str = ""       # value columns per program of the MLA combine + up-projection kernel
    mla_uv_flat: str = ""     # 1 / 0: the constant-split-count combine at every M / never
    mla_uv_warps: str = ""    # warps of that kernel
    mla_combine_bl: str = ""  # columns per program of the MLA combine (0: one program per row)
    conv_block: str = ""      # channels per program of the KDA short-conv kernel
    kda_fb_bv: str = ""       # value columns per program of the KDA f_b / step kernels
    kda_step_p: str = ""      # programs per head of the KDA step kernel
    fla_decode: str = ""      # 0: the KDA decode op without fla-core's kernel
    disable_fla: str = ""     # 1: no fla-core kernel at all (prefill too)
    # runtime, CLI
    symm: str = ""            # 0: no symmetric memory (every communication op on its NCCL path)
    cli_debug: str = ""       # 1: k3c prints the traceback of a failing command

    def key(self) -> str:
        """The knobs set, as stable text (part of the pass manager's cache key)."""
        return json.dumps({k: v for k, v in dataclasses.asdict(self).items() if v}, sort_keys=True)


KNOB_NAMES = tuple(f.name for f in dataclasses.fields(Knobs))
_PARSED: dict[str, Knobs] = {}


def environment() -> dict[str, str]:
    """The whole environment now (distributed.rank_start_method compares it with the fork server's)."""
    return dict(os.environ)


def parse_knobs(text: str) -> dict[str, str]:
    """{name: value} of a K3_KNOBS string; unknown names raise ValueError."""
    out: dict[str, str] = {}
    last = None
    for piece in text.split(","):
        if "=" in piece:
            last, v = piece.split("=", 1)
            last = last.strip()
            if last not in KNOB_NAMES:
                raise ValueError(f"unknown k3 knob {last!r} in {KNOBS_VAR}; knobs: {list(KNOB_NAMES)}")
            out[last] = v
        elif last is not None and piece:
            out[last] += "," + piece
        elif piece.strip():
            raise ValueError(f"{KNOBS_VAR}: {piece!r} is not name=value")
    return out


def knobs() -> Knobs:
    """The experiment knobs now (K3_KNOBS, parsed once per distinct value)."""
    text = os.environ.get(KNOBS_VAR, "")
    k = _PARSED.get(text)
    if k is None:
        k = _PARSED[text] = Knobs(**parse_knobs(text))
    return k


def knob(name: str, default: str = "") -> str:
    """One knob's value, or `default` where it is not set."""
    return getattr(knobs(), name) or default


def knob_flag(name: str, default: bool) -> bool:
    """A 1 / 0 knob as a bool (`default` where unset)."""
    v = getattr(knobs(), name)
    return default if v == "" else v == "1"


def knobs_text(**changes: str) -> str:
    """K3_KNOBS's value now with `changes` applied ("" removes a knob): what a test or a benchmark
    variant sets."""
    cur = parse_knobs(os.environ.get(KNOBS_VAR, ""))
    for k, v in changes.items():
        if k not in KNOB_NAMES:
            raise ValueError(f"unknown k3 knob {k!r}; knobs: {list(KNOB_NAMES)}")
        if v == "" or v is None:
            cur.pop(k, None)
        else:
            cur[k] = str(v)
    return ",".join(f"{k}={v}" for k, v in cur.items())
