"""Decode GEMMs: the Triton GEMV / tensor-core split-K GEMM (kernels/triton_gemv.py), the table that picks
them over cuBLAS, and their `k3::` registrations.

- `gemm(op, x, w)`: x @ w.t() for every GEMM inside the ops and for `k3::decode_gemm`: the CuTe skinny
  GEMM where `cute.artifacts.wanted` says so, else the config of `tuning.GEMV_TABLE` (merged with the
  card's rows, `tuning.GEMV_TABLE_BY_CARD`) for this weight shape and M, else torch.mm (cuBLAS).
- `mma_gemm` / `gemv`: one launch of the tensor-core split-K kernel (M <= 16; the program of a tile
  that arrives last sums the fp32 partials in split order: deterministic, no memset) or of the
  CUDA-core GEMV (M <= 8, plain or LAZY); `mma_gemm2`: two weights in one launch.
- The GEMV after the TP=1 norm as its PDL secondary: the pass pair_pdl finds, in the graph, the norm op
  whose normed output the next decode GEMM op reads, and sets the norm's `trigger` and the GEMM's
  `after_trigger`. The norm kernel then triggers its dependents at its start (comm.ar_residual_norm,
  TRIGGER) and a CUDA-core GEMV called with after_trigger is launched with PDL, its weight rows' first
  bytes requested into L2 before the wait (`gemv_pdl`, `tuning.GEMV_PDL_PF`, read at launch). Same
  sums in the same order. Correct whatever runs between the two: the GEMV reads x (and `out`) only
  after griddepcontrol.wait, which returns once the kernel before it in the stream has completed and
  its writes are visible (triton_gemv.gemv_kernel, PDL); a kernel between costs only the early start.
- `head_bmm`: `k3::decode_bmm`, heads x N blocks, `tl.dot` per K step, M <= 16.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from ..config import knob
from .common import FLOAT, off_thread
from . import triton_gemv, tuning
from .cute import artifacts
from .registry import register

GEMV_MAX_M = 8   # the CUDA-core GEMV's most token rows
# LAZY's [MP, BLOCK_N, BLOCK_K] fp32 tile at most this many registers a thread, else the plain form
GEMV_LAZY_REGS = 64


def gemv_parts(cfg: tuple, mp: int) -> tuple[int, int, int, int, bool]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, lazy) of a CUDA-core GEMV config at MP (a power of two
    >= M) token rows: lazy where the config asks for it and its accumulator tile fits GEMV_LAZY_REGS."""
    bn, bk, nw, ns, *rest = cfg
    lazy = bool(rest and rest[0]) and mp * bn * bk <= GEMV_LAZY_REGS * 32 * nw
    return bn, bk, nw, ns, lazy


def gemv_name(cfg: tuple) -> str:
    """A CUDA-core GEMV config's name as parse_cfg reads it back ("gemv[l] BN/BK/warps/stages")."""
    return ("gemvl " if len(cfg) > 4 and cfg[4] else "gemv ") + "/".join(str(v) for v in cfg[:4])


@dataclass(frozen=True)
class MmaCfg:
    """A config of triton_gemv.mma_gemm_kernel: BN weight rows per program, BK per pipeline stage,
    SPLIT programs along K, warps, pipeline stages, swap (weight rows on the MMA's M side)."""
    bn: int
    bk: int
    split: int
    warps: int = 4
    stages: int = 4
    swap: bool = False

    def name(self) -> str:
        return f"mma{'s' if self.swap else ''} {self.bn}/{self.bk}/{self.split}/{self.warps}/{self.stages}"

    @classmethod
    def parse(cls, text: str) -> "MmaCfg":
        """The inverse of name(): "mma 64/256/2/4/3" or "mmas ..." (swapped)."""
        kind, nums = text.split()
        if kind not in ("mma", "mmas"):
            raise ValueError(f"not an MMA GEMM config: {text!r}")
        return cls(*(int(v) for v in nums.split("/")), swap=kind == "mmas")


MMA_MAX_M = 16          # one MMA tile of tokens

SPLIT_SLOTS, SPLIT_STREAMS = 8192, 8   # split-K counters per stream (tiles of one GEMM), streams per device
_SPLIT: dict[str, tuple[torch.Tensor, dict]] = {}


def split_counters(device: torch.device) -> torch.Tensor | None:
    """The split-K arrival counters of the MMA GEMM for the current stream of `device`: SPLIT_SLOTS
    int32 zeros, each launch leaving them zero (triton_gemv's docstring). One tensor per device,
    made at the first call (on a helper thread: not in a CUDA-graph-trees pool), and a slice of it
    per stream, so that a GEMM on the side stream never shares a counter with one on the main
    stream. None where there are none to be had: the first call inside a CUDA graph capture (no
    allocation there), or more than SPLIT_STREAMS streams; the caller then does not split. A CUDA
    graph keeps the slice of the stream it was captured on: two replays of graphs captured on one
    stream must not run at the same time (on two streams), as two launches on one stream cannot."""
    key = str(device)
    if key not in _SPLIT:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _SPLIT[key] = (off_thread(lambda: torch.zeros(SPLIT_SLOTS * SPLIT_STREAMS, dtype=torch.int32,
                                                       device=device), device), {})
    cnt, slots = _SPLIT[key]
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    if stream not in slots:
        if len(slots) == SPLIT_STREAMS:
            return None
        slots[stream] = len(slots)
    return cnt[slots[stream] * SPLIT_SLOTS:(slots[stream] + 1) * SPLIT_SLOTS]


def head_bmm(x: torch.Tensor, w: torch.Tensor, w_nk: bool = False, gate: torch.Tensor | None = None) -> torch.Tensor:
    """torch.bmm(x, w) ([H, M, K] @ [H, K, N] -> [H, M, N], stored token-major: a permuted view of a
    contiguous [M, H, N]), or with w_nk torch.bmm(x, w.transpose(1, 2)) for w stored [H, N, K]; with
    gate ([M, H, N]) times sigmoid(gate) transposed to [H, M, N]. One launch of
    triton_gemv.head_bmm_kernel, about 96 programs over heads x N blocks."""
    H, M, K = x.shape
    N = w.shape[1] if w_nk else w.shape[2]
    out = torch.empty(M, H, N, dtype=x.dtype, device=x.device).permute(1, 0, 2)
    g = gate if gate is not None else out
    swk, swn = (w.stride(2), w.stride(1)) if w_nk else (w.stride(1), w.stride(2))
    BN = max(16, min(128, triton.next_power_of_2(triton.cdiv(H * N, 96))))
    BK = max(16, min(128, triton.next_power_of_2(K)))
    if M:
        triton_gemv.head_bmm_kernel[(H, triton.cdiv(N, BN))](
            x, w, out, g, M, H, N, K, x.stride(0), x.stride(1), x.stride(2), w.stride(0), swk, swn,
            g.stride(0), g.stride(1), g.stride(2),
            BM=16, BN=BN, BK=BK, IEEE=x.dtype == torch.float32, GATE=gate is not None, num_warps=4)
    return out


def mma_gemm(x: torch.Tensor, w: torch.Tensor, cfg: MmaCfg, out: torch.Tensor | None = None,
             accumulate: bool = False) -> torch.Tensor:
    """x @ w.t() (into `out`, or added to it) by triton_gemv.mma_gemm_kernel, M <= MMA_MAX_M; x [M, K]
    and w [N, K] with unit stride along K, out [M, N] with unit stride along N."""
    M, N = x.shape[0], w.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _mma(x, w, out, None, None, cfg, accumulate)
    return out


def mma_gemm2(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, cfg: "MmaCfg | tuple[int, int, int, int]",
              out1: torch.Tensor | None = None, out2: torch.Tensor | None = None, after_trigger: bool = False):
    """(x @ w1.t(), x @ w2.t()) in ONE launch of the MMA GEMM over the stacked rows [w1; w2] (no copy
    of either weight; `cfg` is the stacked shape's); both weights [*, K] of x's dtype with unit stride
    along K, the outputs [M, N1] / [M, N2] (given: unit stride along N; e.g. two column ranges of one
    buffer). Returns (out1, out2). Where w1's rows are not a multiple of the config's BN (a program's
    rows must lie in one weight), two launches of the same config instead. A CUDA-core GEMV config
    (a tuple, M <= GEMV_MAX_M) runs the same way on gemv_kernel (TWO); after_trigger: gemv's, for its
    first launch (the MMA GEMM has no PDL form)."""
    M = x.shape[0]
    if w1.shape[1] != w2.shape[1] or w1.dtype != w2.dtype:
        raise ValueError(f"mma_gemm2: weights {tuple(w1.shape)} {w1.dtype} and {tuple(w2.shape)} {w2.dtype} "
                         "must share K and dtype")
    out1 = torch.empty(M, w1.shape[0], dtype=x.dtype, device=x.device) if out1 is None else out1
    out2 = torch.empty(M, w2.shape[0], dtype=x.dtype, device=x.device) if out2 is None else out2
    if not isinstance(cfg, MmaCfg):
        _gemv2(x, w1, w2, out1, out2, cfg, after_trigger)
        return out1, out2
    if w1.shape[0] % cfg.bn:
        _mma(x, w1, out1, None, None, cfg, False)
        _mma(x, w2, out2, None, None, cfg, False)
    else:
        _mma(x, w1, out1, w2, out2, cfg, False)
    return out1, out2


def _gemv2(x, w1, w2, out1, out2, cfg: tuple, after_trigger: bool = False) -> None:
    """mma_gemm2's CUDA-core form: one gemv_kernel launch over the stacked rows (TWO), or two launches
    where w1's rows are not a multiple of BLOCK_N (the first one the PDL secondary with after_trigger)."""
    M = x.shape[0]
    if M > GEMV_MAX_M:
        raise ValueError(f"the CUDA-core GEMV takes M <= {GEMV_MAX_M} tokens, got {M}")
    if w1.shape[0] % cfg[0]:
        gemv(x, w1, out1, cfg=cfg, after_trigger=after_trigger)
        gemv(x, w2, out2, cfg=cfg)
    else:
        _gemv_launch(x, w1, out1, cfg, two=(w2, out2), after_trigger=after_trigger)


def gemv_pdl(device: torch.device, shape: tuple[int, int] | None = None) -> int | None:
    """The L2 prefetch bytes of a PDL GEMV launch (0: PDL without prefetch), or None: no PDL. K3_KNOBS gemv_pdl (read at
    each launch, so a benchmark variant can set it while it compiles and captures): "off" = never; "on" =
    GEMV_PDL_PF's bytes for this weight shape (none for a shape not in it); a number = that many bytes for every
    shape; unset = "on" if GEMV_PDL_DEFAULT else "off". CUDA on Hopper or later only. With shape=None: whether
    PDL is on at all (the norm kernel's TRIGGER, where its op has `trigger`)."""
    return _pdl_choice("gemv_pdl", tuning.GEMV_PDL_DEFAULT, _pdl_table(knob("gemv_pdl_pf")), device, shape)


def _pdl_choice(var: str, default_on: bool, table: dict, device: torch.device, shape) -> int | None:
    """gemv_pdl: the switch `var` ("off" / "on" / bytes; unset: default_on) over a table by shape."""
    v = knob(var) or ("on" if default_on else "off")
    if v == "off" or device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return None
    if v != "on":
        return int(v)
    if shape is None:
        return 0 if table else None
    return table.get(tuple(shape))


def _pdl_table(text: str) -> dict:
    """GEMV_PDL_PF, or K3_KNOBS=gemv_pdl_pf="NxK=bytes;..." in its place (bench A/B rows)."""
    if not text:
        return tuning.GEMV_PDL_PF
    out = {}
    for part in text.split(";"):
        shape, _, nbytes = part.partition("=")
        n, _, k = shape.partition("x")
        out[(int(n), int(k))] = int(nbytes)
    return out


def _pdl_rows_ok(w: torch.Tensor, K: int | None = None) -> bool:
    """A weight whose rows are contiguous and 16-byte aligned (the L2 prefetch's); with K, also packed one after
    another (stride K: the GEMV requests a program's rows as one slice)."""
    return (w.stride(1) == 1 and w.data_ptr() % 16 == 0 and (w.stride(0) * w.element_size()) % 16 == 0
            and (K is None or w.stride(0) == K))


def _gemv_launch(x, w, out, cfg: tuple, accumulate: bool = False, pdl: bool = False, two=None,
                 after_trigger: bool = False) -> None:
    """One gemv_kernel launch (gemv's and, with two=(w2, out2): the rows of w then w2, _gemv2's). after_trigger:
    the PDL secondary of the triggering norm kernel launched before it, where gemv_pdl says so for this
    weight shape (and its L2 prefetch where the rows allow it)."""
    M, K = x.shape
    if not M:
        return
    bn, bk, nw, ns, lazy = gemv_parts(cfg, triton.next_power_of_2(M))
    pf = 0
    if after_trigger and not pdl and K >= bk:
        auto = gemv_pdl(x.device, (w.shape[0] + (two[0].shape[0] if two else 0), K))
        if auto is not None:
            pdl = True
            rows_ok = _pdl_rows_ok(w, K) and (two is None or _pdl_rows_ok(two[0], K))
            pf = auto if rows_ok else 0
    w2, out2 = two or (w, out)
    N1 = w.shape[0]
    N = N1 + (w2.shape[0] if two else 0)
    triton_gemv.gemv_kernel[(triton.cdiv(N, bn),)](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
        w2, out2, N1, w2.stride(0) if two else 0, out2.stride(0) if two else 0,
        MP=triton.next_power_of_2(M), BLOCK_N=bn, BLOCK_K=bk,
        EVEN_K=K % bk == 0, ACC=accumulate, PDL=pdl, GDC=pdl and x.is_cuda,
        TWO=two is not None, LAZY=lazy,
        PF=pf, LANES=nw * 32, num_warps=nw, num_stages=ns,
        **({"launch_pdl": True} if pdl and x.is_cuda else {}))


def _split_plan(out: torch.Tensor, N: int, K: int, cfg: MmaCfg, per_program: int):
    """(tiles, split, counters, partials) of an MMA-GEMM launch: SPLIT programs per BN rows (at most one per
    BK of K), the split-K counters of the current stream and fp32 partials of `per_program` floats per
    program; unsplit where no counters are to be had (split_counters), `out` then standing in for both."""
    tiles = triton.cdiv(N, cfg.bn)
    split = max(1, min(cfg.split, triton.cdiv(K, cfg.bk)))
    cnt = split_counters(out.device) if split > 1 and tiles <= SPLIT_SLOTS else None
    if cnt is None:   # no counters for this call: the same product unsplit
        return tiles, 1, out, out
    return tiles, split, cnt, torch.empty(tiles * split * per_program, dtype=torch.float32, device=out.device)


def _mma(x, w, out, w2, out2, cfg: MmaCfg, accumulate: bool) -> None:
    M, K = x.shape[0], w.shape[1]
    N1 = w.shape[0]
    N = N1 + (w2.shape[0] if w2 is not None else 0)
    if M > MMA_MAX_M:
        raise ValueError(f"mma_gemm takes M <= {MMA_MAX_M} tokens, got {M}")
    if not M:
        return
    two = w2 is not None
    tiles, split, cnt, part = _split_plan(out, N, K, cfg, MMA_MAX_M * cfg.bn)
    triton_gemv.mma_gemm_kernel[(tiles, split)](
        x, w, out, part, cnt, M, N, K, x.stride(0), w.stride(0), out.stride(0),
        w2 if two else w, out2 if two else out, N1,
        w2.stride(0) if two else 0, out2.stride(0) if two else 0,
        BM=MMA_MAX_M, BN=cfg.bn, BK=cfg.bk, SPLIT=split, SWAP=cfg.swap,
        EVEN_K=K % cfg.bk == 0, ACC=accumulate, TWO=two,
        num_warps=cfg.warps, num_stages=cfg.stages)


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False,
         cfg: "tuple[int, int, int, int] | MmaCfg | None" = None, pdl: bool = False,
         after_trigger: bool = False) -> torch.Tensor:
    """x @ w.t() (into `out`, or added to it with accumulate=True) by the Triton GEMV, M <= 8, or,
    for an MmaCfg, by the tensor-core split-K kernel (mma_gemm, M <= 16);
    x [M, K] and w [N, K] with unit stride along K, out [M, N] with unit stride along N. pdl: launched
    with Programmatic Dependent Launch, the first weight tile read before waiting for the previous
    kernel (triton_gemv's docstring; an experiment, CUDA sm_90+ only, K >= the config's BLOCK_K).
    after_trigger: the kernel launched right before this one is the norm kernel with TRIGGER (its op's
    `trigger`): the CUDA-core GEMV is then its PDL secondary where gemv_pdl says so, with that table's L2
    prefetch (on CUDA, K >= BLOCK_K; ignored by the MMA GEMM, which has no PDL form)."""
    if isinstance(cfg, MmaCfg):
        if pdl:
            raise ValueError("the MMA GEMM has no PDL form")
        return mma_gemm(x, w, cfg, out, accumulate)
    M, K = x.shape
    if out is None:
        out = torch.empty(M, w.shape[0], dtype=x.dtype, device=x.device)
    cfg = cfg or tuning.GEMV_DEFAULT
    if pdl and K < cfg[1]:
        raise ValueError(f"gemv(pdl=True) needs K >= BLOCK_K (K={K}, BLOCK_K={cfg[1]})")
    _gemv_launch(x, w, out, cfg, accumulate, pdl, after_trigger=after_trigger)
    return out


CUTE_GEMM_OPS = ("oproj",)  # the GEMMs the CuTe skinny GEMM was built for (N = hidden)
_TABLES: dict[str, dict] = {}


@functools.lru_cache(maxsize=None)
def _card_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def card_rows(device) -> dict:
    """tuning.GEMV_TABLE_BY_CARD's rows for this CUDA device: those of the first key that is a substring of the
    GPU's name; K3_KNOBS=gemv_card=<key> forces a key's rows, =none turns them off; {} if none."""
    forced = knob("gemv_card")
    if forced:
        return tuning.GEMV_TABLE_BY_CARD.get(forced, {})
    if getattr(device, "type", None) != "cuda":
        return {}
    name = _card_name(device.index if device.index is not None else torch.cuda.current_device())
    return next((rows for key, rows in tuning.GEMV_TABLE_BY_CARD.items() if key in name), {})


@functools.lru_cache(maxsize=None)
def parse_cfg(text):
    """A gemv_bench config name: "gemv BN/BK/warps/stages" (the CUDA-core GEMV, a tuple; "gemvl": its
    LAZY form, a fifth element 1) or
    "mma[s] BN/BK/SPLIT/warps/stages" (the tensor-core split-K kernel, an MmaCfg); None and
    configs already parsed pass through."""
    if text is None or not isinstance(text, str):
        return text
    if text.startswith("mma"):
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
    """The GEMV config for x @ w.t() (into out), or None where cuBLAS runs it: the entry of
    tuning.GEMV_TABLE (merged per M with the card's rows, card_rows) for this weight shape at the
    smallest measured M >= x's M. rows: look up the table for a weight of that many rows instead of
    w's (two stacked weights: mma_gemm2). Knobs, over the table: K3_KNOBS=gemv_table=<gemv_bench JSON>
    uses a sweep's result instead (no card rows); gemv_cfg="NxK=config;NxK=cublas" forces one weight
    shape's config at every M (_forced); gemv=1 forces the CUDA-core GEMV (tuning.GEMV_DEFAULT) for
    every shape without an entry at M <= GEMV_MAX_M; gemv=0 turns every decode GEMM off (cuBLAS)."""
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
    by_m = (gemv_table_from(path) if path else tuning.GEMV_TABLE).get(shape, {})
    if not path:
        by_m = {**by_m, **card_rows(x.device).get(shape, {})}
    fit = [mm for mm in sorted(by_m) if mm >= m]
    if fit:
        return parse_cfg(by_m[fit[0]])
    if rows is not None:
        return None
    return tuning.GEMV_DEFAULT if flag not in ("", "0") and m <= GEMV_MAX_M else None


def gemm(op: str, x: torch.Tensor, w: torch.Tensor, after_trigger: bool = False) -> torch.Tensor:
    """x @ w.t(): the CuTe skinny GEMM where wanted and possible, else the Triton GEMV where it
    measured faster for this weight shape and M (GEMV_TABLE), else torch.mm. after_trigger: gemv's."""
    m = x.shape[0]
    if op in CUTE_GEMM_OPS and x.is_cuda and x.dim() == 2 and artifacts.wanted(op, m):
        key = f"{op} N={w.shape[0]} K={x.shape[1]} M={m}"
        if x.dtype != torch.bfloat16 or w.dtype != x.dtype:
            artifacts.note(key, f"dtype {x.dtype} (the CuTe kernels are bf16)")
        else:
            try:
                art, why = artifacts.find("gemm", "oproj_gemm", w.shape[0], x.shape[1], m)
                if art is not None:
                    return art.launch_gemm(x.contiguous(), w.contiguous())
                artifacts.note(key, why)
            except Exception as e:  # noqa: BLE001 - any loader failure falls back, with the reason
                artifacts.note(key, f"loader error: {type(e).__name__}: {e}")
    cfg = gemv_plan(x, w)
    if cfg is not None:
        return gemv(x, w, cfg=cfg, after_trigger=after_trigger)
    return torch.mm(x, w.t())


def gemm_add_(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out += x @ w.t() in place (out may be a column slice): the Triton GEMV where GEMV_TABLE says
    so, else addmm_."""
    cfg = gemv_plan(x, w, out)
    if cfg is not None:
        return gemv(x, w, out=out, accumulate=True, cfg=cfg)
    return out.addmm_(x, w.t())


def two_weight_cfg(x, w1, w2, rows: int) -> "MmaCfg | tuple | None":
    """The tuned config of a [rows, K] weight at x's M, for mma_gemm2 over rows of w1 and w2: an MMA
    config, or a CUDA-core GEMV one at M <= GEMV_MAX_M (None: cuBLAS in the table, or an operand not
    unit-stride along K)."""
    cfg = gemv_plan(x, w1, rows=rows)
    ok = (isinstance(cfg, MmaCfg) or (cfg is not None and x.shape[0] <= GEMV_MAX_M)) and x.stride(1) == 1 \
        and w1.stride(1) == 1 and w2.stride(1) == 1
    return cfg if ok else None


def cfg_bn(cfg) -> int:
    """The rows per program of an MMA or CUDA-core GEMV config."""
    return cfg.bn if isinstance(cfg, MmaCfg) else cfg[0]


# ------------------------------------------------------------------ registrations
def _ok_gemm(x, w, after_trigger=False):
    return x.dim() == 2 and w.dim() == 2 and x.dtype in FLOAT and w.dtype == x.dtype


@register("decode_gemm", "cuda", "triton_mma_gemm_or_cublas", _ok_gemm)
def _decode_gemm(x, w, after_trigger=False):
    return gemm("decode_gemm", x, w, after_trigger)   # the tuned table's kernel for (N, K, M), else torch.mm


def _ok_bmm(x, w, w_nk, gate=None):
    return (knob("decode_bmm", "1") != "0" and x.dim() == 3 and w.dim() == 3 and x.dtype in FLOAT
            and w.dtype == x.dtype and x.shape[1] <= 16 and x.shape[0] == w.shape[0]
            and x.shape[2] == (w.shape[2] if w_nk else w.shape[1])
            and (gate is None or (gate.dtype == x.dtype
                                  and tuple(gate.shape) == (x.shape[1], x.shape[0], w.shape[1] if w_nk else w.shape[2]))))


@register("decode_bmm", "cuda", "triton_head_bmm", _ok_bmm)
def _decode_bmm(x, w, w_nk, gate=None):
    return head_bmm(x, w, w_nk, gate)   # K3_KNOBS=decode_bmm=0: the op's reference (torch.bmm) instead
