"""Communication: the launchers of the Triton communication kernels (kernels/triton_comm.py,
kernels/triton_cols.py), the whole communication ops, and their `k3::` registrations.

`Peers` names this rank's view of a symmetric buffer: every rank's address, every rank's signal
pad, this rank's index and the world size. On the GPU it comes from `runtime.symm.Workspace`;
CPU tests (TRITON_INTERPRET=1) build one from ordinary tensors to simulate the other ranks.

The ops (registered at the end):
- oproj_allreduce_residual: cuBLAS GEMM (`gemm.gemm`), then one Triton kernel: copy of the partial into
  this rank's symmetric buffer, barrier, peer loads over NVLink (one-shot all-reduce), residual add,
  AttnRes / RMSNorm post-norm. At TP=1 the same kernel without peers. Where `push_gemm` picks it, the
  CuTe push GEMM instead stores the partial into every rank's buffer with per-tile flags, and the
  Triton kernel waits on the flags and reads only its own buffer. At one row and TP >= 2
  (`cols_plan`) the kernel's column-split form (kernels/triton_cols.py) instead.
- residual_norm: the o-proj op's all-reduce + residual + norm kernel on a given delta (no GEMM);
  at TP=1, or for a delta that is no all-reduce's, the same kernel without peers.
- moe_latent_tail: one Triton kernel (weighted top-k finalize into the symmetric buffer,
  one-shot all-reduce, RMSNorm, copy of the shared partial), then a cuBLAS addmm adding the
  up-projection shard into this rank's columns (the column-split kernel where `cols_plan` says).
- router_latent_sharded: one GEMM on this rank's rows of [W_r; W_down] (a view of one weight, or
  for the one rank whose rows straddle both one launch over both (`gemm.mma_gemm2`) where the
  tuned config's tile divides its router rows, else a copy made once, `rank_rows`), then
  one Triton kernel: copy into the symmetric buffer, all-gather, write router logits and latent.
  Above its one-shot range it runs the replicated GEMMs (what the unrewritten graph did). At TP=1:
  both GEMMs in one launch of the decode GEMM over the stacked weights (`router_latent_one`).
- all_reduce_prefetch: one Triton kernel (copy in, one-shot all-reduce).
- L2 prefetch: on the side stream, started before the communication kernel, joined after it.

The one-shot path needs a TP group with a symmetric-memory workspace large enough for the call and
M within `tuning.ONESHOT_M` (measured); otherwise the op takes its NCCL path (GEMM, NCCL
collective, our norm kernel), and `runtime.symm.status()` says why symmetric memory is absent.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..config import knob, knob_flag
from ..rounding import MIX_KEY_FP32, MIX_KEY_WEIGHTED, MIX_SUM_FP32, NORM_CAST_FIRST, NORM_IN_DTYPE
from ..runtime import streams, symm
from ..runtime.symm import MAX_PROGRAMS
from . import gemm, triton_cols, triton_comm, tuning
from .common import FLOAT, TL, off_thread
from .cute import artifacts
from .registry import register

# the barrier protocol of the communication kernels (triton_comm's docstring): 1 = sequence flags
# (one posted write per peer), 0 = the CAS handshake. Read once: every rank and every kernel of a
# process must use the same one (the two leave different values in the signal slots).
SEQ_BARRIER = int(knob("barrier_seq", "1"))
# bench sweeps only: warps of the all-reduce/norm kernel (0: by width). At group size 1 (one H200, a
# run where K3_KNOBS ar_warps was read at each launch for layer_bench's env
# variants; layer_*_tp8_w1_h200_96a1ab8_warps.json, BENCHMARKS.md)
# 16 warps were equal to the 8 of _warps and 32 slower (+1.5-4 us per layer step at M = 1 / 4 / 16)
AR_WARPS = int(knob("ar_warps", "0"))
# bench A/B only (read at launch): COMM_EARLY=0 puts the communication kernels' peer-independent
# reads back after the barrier wait; COMM_VEC=0 signals and polls the peers one after another
# instead of in one vector atomic each (triton_comm._signal / _wait)
COMM_EARLY = knob("comm_early", "1") == "1"
COMM_VEC = knob("comm_vec", "1") == "1"
# the all-reduce / norm kernel's forms (triton_comm.ar_residual_norm_kernel, measured: tuning.AR_PRELOAD,
# AR_LEAN_MIN_WORLD, AR_WARPS_M1): PRELOAD (K3_KNOBS=ar_preload=0: off); LEAN and JOINT, None = by group size
# and rows (_ar_form), True / False = always / never (K3_KNOBS=ar_lean / ar_joint = 1 / 0)
AR_PRELOAD = knob_flag("ar_preload", tuning.AR_PRELOAD)
AR_LEAN = {"1": True, "0": False}.get(knob("ar_lean"))
AR_JOINT = {"1": True, "0": False}.get(knob("ar_joint"))
COLS_PROBE: dict = {}   # bench/cols_probe.py only: GEN / SYNC of the column-split kernels
AR_W1_FIRST = True  # group size 1 (joint): the row's loads all before its store (triton_comm._ar_row_w1)


def _ar_form(world: int, M: int, block: int) -> tuple[bool, int, bool]:
    """(LEAN, num_warps, JOINT) of ar_residual_norm_kernel for a group size, rows and row width
    (AR_LEAN, AR_WARPS, AR_JOINT)."""
    lean = AR_LEAN if AR_LEAN is not None else world >= tuning.AR_LEAN_MIN_WORLD
    one_row_w8 = world >= 8 and M == 1 and block == 8192
    joint = AR_JOINT if AR_JOINT is not None else world == 1 or one_row_w8
    if AR_WARPS:
        return lean, AR_WARPS, joint
    return lean, tuning.AR_WARPS_M1 if one_row_w8 else _warps(block), joint


def _comm() -> dict:
    """The communication kernels' ordering options (COMM_EARLY, COMM_VEC)."""
    return dict(EARLY=COMM_EARLY, VEC=COMM_VEC)


@dataclass
class Peers:
    ptrs: torch.Tensor   # int64 [world]: every rank's buffer address
    pads: torch.Tensor   # int64 [world]: every rank's signal-pad address
    epoch: torch.Tensor  # int32 [3]: this rank's buffer-half selector, arrival counter, call count
    rank: int
    world: int
    nbytes: int          # buffer size (two halves)
    programs: int        # most programs per kernel (signal-pad slots / world)
    flag_off: int = -1   # byte offset of the push flags in every rank's buffer (-1: none)

    def half(self, dtype: torch.dtype) -> int:
        """Elements of `dtype` in one buffer half."""
        return self.nbytes // 2 // torch.empty((), dtype=dtype).element_size()


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def _programs(n: int, peers: "Peers | None") -> int:
    return max(1, min(n, peers.programs if peers is not None else MAX_PROGRAMS))


@dataclass(frozen=True)
class ColsPlan:
    """A column-split launch (triton_cols): `programs` programs of `w` columns, every row padded to
    `rows`, AttnRes sources padded to `s_pad`."""
    programs: int
    w: int
    rows: int
    s_pad: int

    @property
    def p_pad(self) -> int:
        return triton.next_power_of_2(self.programs)


def cols_plan(M: int, N: int, sources: int, peers: "Peers | None") -> ColsPlan | None:
    """The column-split form for M rows of width N with `sources` AttnRes sources per row (1: a
    plain norm), or None where the row kernels run: K3_KNOBS=cols=0, a group smaller than COLS_MIN_WORLD
    (unless K3_KNOBS=cols=1), M > COLS_MAX_M, more than 8 sources, a row too narrow to split, or one that
    would need more than COLS_MAX_PROGRAMS programs (or barrier slots) at COLS_MAX_TILE."""
    on = knob_flag("cols", tuning.COLS and (peers.world if peers is not None else 1) >= tuning.COLS_MIN_WORLD)
    if not on or M < 1 or M > int(knob("cols_max_m") or tuning.COLS_MAX_M) or sources > 8 or N < 64:
        return None
    rows = triton.next_power_of_2(M)
    s_pad = max(2, triton.next_power_of_2(sources))
    cap = min(tuning.COLS_MAX_PROGRAMS, peers.programs if peers is not None else tuning.COLS_MAX_PROGRAMS)
    w = max(32, triton.next_power_of_2(int(knob("cols_w") or tuning.COLS_W)))
    while w > 32 and rows * s_pad * w > tuning.COLS_MAX_TILE:   # the [rows, sources, w] tile a program holds
        w //= 2
    programs = triton.cdiv(N, w)
    if programs < 2 or programs > cap or rows * s_pad * w > tuning.COLS_MAX_TILE or \
            triton.next_power_of_2(programs) * rows * s_pad * s_pad > 16384:  # the exchange's load
        return None
    return ColsPlan(programs, w, rows, s_pad)


_COLS_WS: dict = {}
_COLS_SLOTS = 1 << 18   # floats: programs x rows x (s_pad^2 + s_pad) fits (64 x 4 x 72 at most)


def _cols_ws(device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(barrier, slots) of the column-split kernels on this device: int32 [64] (arrivals at 0, generation
    at 32, 128 bytes apart; self-resetting) and fp32 partials. Allocated once per device and kept (one
    launch at a time uses it: the k3 ops that run these kernels are all on the layer's main stream).
    None inside a CUDA graph capture before it exists (the caller then runs the row kernels; graph
    captures warm up first)."""
    ws = _COLS_WS.get(device)
    if ws is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        ws = off_thread(lambda: torch.zeros(64 + _COLS_SLOTS, dtype=torch.int32, device=device), device)
        _COLS_WS[device] = ws
    return ws[:64], ws[64:].view(torch.float32)


def _phases(device: torch.device) -> tuple[int, ...]:
    """One launch with the grid barrier on the GPU; two at the barrier where programs run one after
    another (the interpreter)."""
    return (0,) if device.type == "cuda" else (1, 2)


def rnd_bits(rounding: int = 0, mix_rounding: int = 0) -> int:
    """The communication kernels' RND constexpr (triton_comm's docstring) from the ops' rounding
    arguments (k3compile/rounding.py's bits): bit 0 the post-norm's NORM_CAST_FIRST, bit 1
    MIX_KEY_FP32, bit 2 MIX_SUM_FP32. The other bits are fp32-rounding-level spellings (rsqrt / div / reciprocal, softmax
    or unrolled), which the kernels' fp32 math does not tell apart; the registrations below decline
    what the kernels cannot follow (rounds_as_kernels)."""
    return ((1 if rounding & NORM_CAST_FIRST else 0) | (2 if mix_rounding & MIX_KEY_FP32 else 0)
            | (4 if mix_rounding & MIX_SUM_FP32 else 0))


def rounds_as_kernels(rounding: int, mix_rounding: int = 0) -> bool:
    """Whether the norm kernels follow these rounding orders: not a norm computed in the 16-bit input
    dtype, nor AttnRes keys normed with their own weight (the kernels dot the normed row with
    w_norm * w_qk): those run the op's reference."""
    return not (rounding & NORM_IN_DTYPE or mix_rounding & (NORM_IN_DTYPE | MIX_KEY_WEIGHTED))


def ar_residual_norm(local: torch.Tensor | None, peers: Peers | None, residual: torch.Tensor | None,
                     g: torch.Tensor | None, w_norm, w_qk, blocks: list[torch.Tensor], eps: float,
                     pushed: tuple[int, int, torch.dtype] | None = None, rnd: int = 0, trigger: bool = False):
    """(updated, normed): updated = residual + sum_ranks(local); normed as the o-proj op (empty
    when g is None). `local` is this rank's [M, N] partial; peers None means TP=1.
    pushed = (M, N, dtype): the partials are already in the buffers (the CuTe push GEMM ran);
    `local` is None. rnd: the rounding order (rnd_bits). trigger: the GEMM launched next reads `normed`
    as this kernel's PDL secondary (the ops' `trigger`, pair_pdl): the row kernel without peers, with a
    norm, lets it launch at its start (TRIGGER) where PDL is on (gemm.gemv_pdl)."""
    if pushed is not None:
        M, N, dt = pushed
        local = residual if residual is not None else peers.ptrs   # a placeholder pointer, unread
    else:
        M, N = local.shape
        dt = local.dtype
    upd = torch.empty(M, N, dtype=dt, device=local.device)
    nrm = torch.empty(M, N, dtype=dt, device=local.device) if g is not None else upd.new_empty(0)
    bs = list(blocks) + [upd] * (8 - len(blocks))
    plan = cols_plan(M, N, len(blocks) + 1, peers) if g is not None and pushed is None else None
    ws = _cols_ws(local.device) if plan is not None else None
    if ws is not None:
        bar, slots = ws
        for phase in _phases(local.device):
            triton_cols.ar_norm_cols_kernel[(plan.programs,)](
                peers.ptrs if peers else local, peers.pads if peers else local, peers.epoch if peers else local,
                peers.half(dt) if peers else 0, local, residual if residual is not None else local, upd, nrm, g,
                w_norm if w_norm is not None else g, w_qk if w_qk is not None else g, *bs, bar, slots, M, N, eps,
                RANK=peers.rank if peers else 0, WORLD=peers.world if peers else 1, NB=len(blocks),
                HAS_RES=residual is not None, ROWS=plan.rows, W=plan.w, S_PAD=plan.s_pad, P_PAD=plan.p_pad,
                DTYPE=TL[dt], SEQ=SEQ_BARRIER, VEC=COMM_VEC, PHASE=phase, RND=rnd, num_warps=4, **COLS_PROBE)
        return upd, nrm
    BLOCK = triton.next_power_of_2(N)
    lean, warps, joint = _ar_form(peers.world if peers else 1, M, BLOCK)
    # at TP=1 with a norm: one program per row, so the GEMV after it may stream its weights meanwhile
    trigger = (trigger and peers is None and g is not None and pushed is None
               and gemm.gemv_pdl(local.device) is not None)
    triton_comm.ar_residual_norm_kernel[(_programs(M, peers),)](
        peers.ptrs if peers else local, peers.pads if peers else local, peers.epoch if peers else local,
        peers.half(dt) if peers else 0, local,
        residual if residual is not None else local, upd, nrm,
        g if g is not None else local, w_norm if w_norm is not None else local,
        w_qk if w_qk is not None else local, *bs, M, N, eps, peers.flag_off if pushed else 0, triton.cdiv(N, 64),
        RANK=peers.rank if peers else 0, WORLD=peers.world if peers else 1, NB=len(blocks),
        HAS_NORM=g is not None, HAS_RES=residual is not None, BLOCK_N=BLOCK, DTYPE=TL[dt], SEQ=SEQ_BARRIER,
        PUSHED=pushed is not None, PRELOAD=AR_PRELOAD, LEAN=lean, JOINT=joint, W1_FIRST=AR_W1_FIRST,
        TRIGGER=trigger, RND=rnd, num_warps=warps, **_comm())
    return upd, nrm


def latent_tail(y: torch.Tensor, topk_w: torch.Tensor, peers: Peers | None, g: torch.Tensor,
                shared_partial: torch.Tensor, eps: float, rnd: int = 0):
    """(ln, out): ln = RMSNorm(all_reduce(sum_k w_k y_k), g) [M, L]; out = a copy of shared_partial.
    rnd: the norm's rounding order (rnd_bits)."""
    M, TOPK, L = y.shape
    SP = shared_partial.shape[-1]
    dt = y.dtype
    ln = torch.empty(M, L, dtype=dt, device=y.device)
    out = torch.empty_like(shared_partial)
    plan = cols_plan(M, L, 1, peers)
    ws = _cols_ws(y.device) if plan is not None else None
    if ws is not None:
        bar, slots = ws
        for phase in _phases(y.device):
            triton_cols.latent_tail_cols_kernel[(plan.programs,)](
                y, topk_w.contiguous(), peers.ptrs if peers else ln, peers.pads if peers else ln,
                peers.epoch if peers else ln, peers.half(dt) if peers else 0, g, ln, shared_partial, out, bar, slots,
                M, L, SP, eps, TOPK=TOPK, RANK=peers.rank if peers else 0, WORLD=peers.world if peers else 1,
                ROWS=plan.rows, W=plan.w, WSP=triton.next_power_of_2(triton.cdiv(SP, plan.programs)),
                P_PAD=plan.p_pad, DTYPE=TL[dt], SEQ=SEQ_BARRIER, VEC=COMM_VEC, PHASE=phase, RND=rnd, num_warps=4,
                **COLS_PROBE)
        return ln, out
    BLOCK = triton.next_power_of_2(L)
    triton_comm.latent_tail_kernel[(_programs(M, peers),)](
        y, topk_w.contiguous(), peers.ptrs if peers else ln, peers.pads if peers else ln,   # ln: unread at TP=1
        peers.epoch if peers else ln, peers.half(dt) if peers else 0,
        g, ln, shared_partial, out, M, L, SP, eps,
        TOPK=TOPK, RANK=peers.rank if peers else 0, WORLD=peers.world if peers else 1,
        BLOCK_N=BLOCK, BLOCK_SP=triton.cdiv(SP, 1024) * 1024, DTYPE=TL[dt], SEQ=SEQ_BARRIER, RND=rnd,
        num_warps=_warps(BLOCK), **_comm())
    return ln, out


def router_latent_split(E: int, L: int, tp: int, rank: int) -> tuple[int, int, int]:
    """(S, a, S1): this rank's column block [a, a+S) of [router | latent] and its router width S1."""
    S = (E + L) // tp
    a = rank * S
    return S, a, min(max(E - a, 0), S)


def gather_router_latent(shard: torch.Tensor, peers: Peers, M: int, E: int, L: int):
    S, _, _ = router_latent_split(E, L, peers.world, peers.rank)
    router = torch.empty(M, E, dtype=shard.dtype, device=shard.device)
    latent = torch.empty(M, L, dtype=shard.dtype, device=shard.device)
    BLOCK = 1024
    triton_comm.gather_router_latent_kernel[(_programs(triton.cdiv(M * (E + L), BLOCK), peers),)](
        peers.ptrs, peers.pads, peers.epoch, peers.half(shard.dtype), shard, router, latent, M, S, E, L,
        RANK=peers.rank, WORLD=peers.world, BLOCK=BLOCK, DTYPE=TL[shard.dtype], SEQ=SEQ_BARRIER,
        VEC=COMM_VEC, num_warps=4)
    return router, latent


def l2_prefetch(t: torch.Tensor, lanes: int = 128) -> None:
    nbytes = t.numel() * t.element_size()
    if nbytes < 4096:
        return
    triton_comm.l2_prefetch_kernel[(triton.cdiv(nbytes // 4096, lanes),)](
        t.view(-1).view(torch.uint8), nbytes, LANES=lanes, num_warps=lanes // 32)


# ------------------------------------------------------------------ whole ops (device-agnostic)
def _no_prefetch():
    return lambda: None


def oproj(x, w, peers: Peers | None, residual, blocks, w_norm, w_qk, g, eps, start_prefetch=_no_prefetch,
          push=None, rnd: int = 0, trigger: bool = False):
    """The o-proj op: GEMM, then the all-reduce + residual + norm kernel. `start_prefetch()`
    runs between the two and returns the function that joins the prefetch. push: the CuTe
    push-epilogue GEMM artifact (push_gemm): the GEMM stores this rank's partial into every
    rank's buffer and flags it, and the kernel after it reads only this rank's buffer. rnd: the
    rounding order (rnd_bits); trigger: ar_residual_norm's."""
    if push is not None:
        push.launch_push(x.contiguous(), w.contiguous(), peers, peers.flag_off)
        pushed = (x.shape[0], w.shape[0], x.dtype)
        part = None
    else:
        part = gemm.gemm("oproj", x, w)  # CuTe where cute.artifacts.wanted says so, else the tuned GEMM or torch.mm
        pushed = None
    join = start_prefetch()
    upd, nrm = ar_residual_norm(part, peers, residual, g, w_norm, w_qk, list(blocks), eps, pushed, rnd, trigger)
    join()
    return upd, nrm


def moe_tail(y, topk_w, peers: Peers | None, shared_partial, g_latent, w_up, eps, rank,
             start_prefetch=_no_prefetch, rnd: int = 0):
    """The latent-tail op: finalize + all-reduce + norm kernel, then addmm into this rank's columns."""
    join = start_prefetch()
    ln, out = latent_tail(y, topk_w, peers, g_latent, shared_partial, eps, rnd)
    join()
    return add_up_shard(out, ln, w_up, rank)


def add_up_shard(out, ln, w_up, rank):
    """out[:, this rank's columns] += ln @ w_up.T (all columns when w_up covers them), in place."""
    n = w_up.shape[0]
    gemm.gemm_add_(out if n == out.shape[-1] else out[:, rank * n:(rank + 1) * n], ln, w_up)
    return out


_RANK_ROWS: dict[tuple, tuple] = {}


def rank_rows(w_router: torch.Tensor, w_down: torch.Tensor, tp: int, rank: int) -> torch.Tensor | None:
    """This rank's rows [a, a+S) of [W_r; W_down] as one [S, K] weight, so that its shard is ONE
    GEMM: a view where the rows lie in one of the two weights; where they straddle both (one rank
    of the group), a concatenated copy (S x K, e.g. 8 MB per MoE layer at TP=8) made on the first
    call and reused while both weights are alive and unchanged (their version counters; an in-place
    weight update makes a new copy). None inside a CUDA graph capture before the copy exists."""
    E, L = w_router.shape[0], w_down.shape[0]
    S, a, S1 = router_latent_split(E, L, tp, rank)
    if S1 == S:
        return w_router[a:a + S]
    if S1 == 0:
        return w_down[a - E:a - E + S]
    key = (w_router.device, w_router.data_ptr(), w_down.data_ptr(), tuple(w_router.shape), tuple(w_down.shape),
           w_router.dtype, tp, rank)
    ver = (w_router._version, w_down._version)
    hit = _RANK_ROWS.get(key)
    # the first weights seen still alive: their memory was not freed and reused by other tensors
    if hit is not None and hit[0]() is not None and hit[1]() is not None and hit[2] == ver:
        return hit[3]
    if w_router.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    import weakref
    w = off_thread(lambda: torch.cat([w_router[a:], w_down[:S - S1]]), w_router.device)
    _RANK_ROWS[key] = (weakref.ref(w_router), weakref.ref(w_down), ver, w)
    weakref.finalize(w_router, _RANK_ROWS.pop, key, None)  # the copy goes with the weights
    return w


def router_latent_shard(x, w_router, w_down, tp: int, rank: int) -> torch.Tensor:
    """This rank's rows of [W_r; W_down] times x: [M*S], row-major [M, S] (router columns first).
    The rank whose rows straddle both weights runs one launch of the MMA GEMM over its rows of each
    (mma_gemm2, no copy) where the tuned table has [S, K] at this M and its router rows are a multiple
    of the config's BN; otherwise one GEMM over the kept copy (rank_rows)."""
    S, a, S1 = router_latent_split(w_router.shape[0], w_down.shape[0], tp, rank)
    if 0 < S1 < S:
        cfg = gemm.two_weight_cfg(x, w_router, w_down, S)
        if cfg is not None and S1 % gemm.cfg_bn(cfg) == 0:
            out = torch.empty(x.shape[0], S, dtype=x.dtype, device=x.device)
            gemm.mma_gemm2(x, w_router[a:], w_down[:S - S1], cfg, out1=out[:, :S1], out2=out[:, S1:])
            return out.view(-1)
    w = rank_rows(w_router, w_down, tp, rank)
    if w is not None:
        return gemm.gemm("router_shard", x, w).view(-1)
    return torch.cat([torch.mm(x, w_router[a:].t()), torch.mm(x, w_down[:S - S1].t())], 1).view(-1)


def router_latent_one(x, w_router, w_down, after_trigger: bool = False):
    """TP=1: (x @ W_r.T, x @ W_down.T) in one launch of the MMA decode GEMM over the stacked rows
    (mma_gemm2; the MMA or the CUDA-core GEMV kernel) where the tuned table has the stacked shape
    [E + L, K] at this M; else each GEMM through gemm.gemm (its own tuned config, or cuBLAS).
    after_trigger: the first launch is the PDL secondary of the norm kernel before it (gemm.gemv's)."""
    cfg = gemm.two_weight_cfg(x, w_router, w_down, w_router.shape[0] + w_down.shape[0])
    if cfg is not None:
        return gemm.mma_gemm2(x, w_router, w_down, cfg, after_trigger=after_trigger)
    return gemm.gemm("router", x, w_router, after_trigger=after_trigger), gemm.gemm("latent", x, w_down)


def router_latent(x, w_router, w_down, peers: Peers):
    """The sharded router + latent op: this rank's shard, then the all-gather kernel."""
    shard = router_latent_shard(x, w_router, w_down, peers.world, peers.rank)
    return gather_router_latent(shard, peers, x.shape[0], w_router.shape[0], w_down.shape[0])


def residual_norm(delta, peers: Peers | None, residual, blocks, w_norm, w_qk, g, eps, start_prefetch=_no_prefetch,
                  rnd: int = 0, trigger: bool = False):
    """The layer-input op: one kernel, the all-reduce of delta (peers None: delta as it is) +
    residual add + AttnRes / RMSNorm (ar_residual_norm_kernel, the o-proj op's kernel without its GEMM).
    trigger: ar_residual_norm's."""
    join = start_prefetch()
    out = ar_residual_norm(delta, peers, residual, g, w_norm, w_qk, list(blocks), eps, None, rnd, trigger)
    join()
    return out


def all_reduce(x, peers: Peers, start_prefetch=_no_prefetch):
    join = start_prefetch()
    out, _ = ar_residual_norm(x, peers, None, None, None, None, [], 0.0)
    join()
    return out


_PUSH: dict[tuple, object] = {}


def push_gemm(x: torch.Tensor, w: torch.Tensor, peers, group: str):
    """The CuTe push-epilogue o-proj GEMM (cute/skinny_gemm.SkinnyGemmPushSm90) for this call, or
    None: the op then runs its GEMM + pull all-reduce kernel. Wanted where tuning.CUTE_M["oproj_push"]
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
    if flag != "1" and not artifacts.wanted("oproj_push", m):
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
            art, why = artifacts.find("gemm", "oproj_push", n, k, m)
            if art is not None:   # load it now: a rank that cannot must say so before any rank pushes
                _load(art, x.device)
        except Exception as e:  # noqa: BLE001 - any loader failure falls back, with the reason
            art, why = None, f"loader error: {type(e).__name__}: {e}"
    ok = _all_ranks(art is not None, group, x.device)
    if art is not None and not ok:
        why = "another rank of the group cannot run it"
    if why:
        artifacts.note(f"oproj_push N={n} K={k} M={m}", why)
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
                + "; otherwise cuBLAS + pull, cute.artifacts.fallbacks() says why)")
    lo, hi = tuning.CUTE_M.get("oproj_push", (1, 0))
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


# ------------------------------------------------------------------ registrations
def _nccl_all_reduce_(t: torch.Tensor, group: str) -> torch.Tensor:
    """In-place NCCL all-reduce through c10d (capturable; no functional-collective copy)."""
    import torch.distributed as dist
    dist.all_reduce(t, group=dist.distributed_c10d._resolve_process_group(group))
    return t


def _peers(group: str | None, device, nbytes: int, op: str | None = None, m: int = 0):
    """(ok, peers): peers is None at TP=1; ok is False when the group cannot use symmetric memory
    (or M is above the op's one-shot range)."""
    if not group:
        return True, None
    if op is not None and not tuning.ONESHOT_M[op][0] <= m <= tuning.ONESHOT_M[op][1]:
        return False, None
    ws = symm.workspace(group, device)
    if ws is None or not ws.fits(nbytes):
        if ws is not None:
            symm.note_unavailable(f"{group}/size", f"a call needs {nbytes} bytes > workspace {ws.buf.numel()}")
        return False, None
    return True, Peers(ws.ptrs, ws.pads, ws.epoch, ws.rank, ws.world, ws.data_bytes, ws.programs, ws.flag_off)


def _prefetcher(weights: list[torch.Tensor]):
    """start() -> join(): L2 prefetch of `weights` on the side stream while the caller communicates."""
    def start():
        if not weights:
            return lambda: None
        side = streams.side_stream(weights[0].device)
        cur = torch.cuda.current_stream(weights[0].device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            for w in weights:
                if w.is_contiguous():
                    l2_prefetch(w)
            ev = torch.cuda.Event()
            ev.record(side)
        return lambda: cur.wait_event(ev)
    return start


def _ok_oproj(x, w, residual, blocks, w_norm, w_qk, g, eps, group, prefetch, rounding=0, mix_rounding=0,
              trigger=False):
    return (x.dim() == 2 and residual.dim() == 2 and x.dtype in FLOAT and w.dtype == x.dtype
            and residual.dtype == x.dtype and len(blocks) <= 8 and residual.is_contiguous()
            and all(b.is_contiguous() and b.shape == residual.shape for b in blocks)
            and rounds_as_kernels(rounding, mix_rounding))


@register("oproj_allreduce_residual", "cuda", "symm_oneshot_triton", _ok_oproj)
def _oproj(x, w, residual, blocks, w_norm, w_qk, g, eps, group, prefetch, rounding=0, mix_rounding=0,
           trigger=False):
    M, N = residual.shape
    rnd = rnd_bits(rounding, mix_rounding)
    ok, peers = _peers(group, x.device, M * N * x.element_size(), "oproj_allreduce_residual", M)
    if not ok:  # NCCL path: GEMM, NCCL all-reduce, our residual + norm kernel
        y = _nccl_all_reduce_(torch.mm(x, w.t()), group)
        return ar_residual_norm(y, None, residual, g, w_norm, w_qk, list(blocks), eps, None, rnd, trigger)
    return oproj(x, w, peers, residual, blocks, w_norm, w_qk, g, eps, _prefetcher(prefetch),
                 push_gemm(x, w, peers, group), rnd, trigger)


def _ok_resnorm(delta, residual, blocks, w_norm, w_qk, g, eps, group, prefetch, rounding=0, mix_rounding=0,
                trigger=False):
    return (delta.dim() == 2 and delta.dtype in FLOAT and delta.is_contiguous() and residual.dtype == delta.dtype
            and residual.shape == delta.shape and residual.is_contiguous() and len(blocks) <= 8
            and all(b.is_contiguous() and b.shape == residual.shape for b in blocks)
            and rounds_as_kernels(rounding, mix_rounding))


@register("residual_norm", "cuda", "symm_oneshot_triton", _ok_resnorm)
def _resnorm(delta, residual, blocks, w_norm, w_qk, g, eps, group, prefetch, rounding=0, mix_rounding=0,
             trigger=False):
    M, N = residual.shape
    ok, peers = _peers(group, delta.device, M * N * delta.element_size(), "residual_norm", M)
    if not ok:  # NCCL path: NCCL all-reduce, then our residual + norm kernel
        delta, peers = _nccl_all_reduce_(delta.clone(), group), None
    return residual_norm(delta, peers, residual, blocks, w_norm, w_qk, g, eps, _prefetcher(prefetch),
                         rnd_bits(rounding, mix_rounding), trigger)


def _ok_tail(y, topk_w, shared_partial, g_latent, w_up, eps, rank, group, prefetch, rounding=0):
    return (y.dim() == 3 and y.dtype in FLOAT and y.is_contiguous() and shared_partial.dtype == y.dtype
            and shared_partial.is_contiguous() and w_up.dtype == y.dtype and topk_w.shape == y.shape[:2]
            and rounds_as_kernels(rounding))


@register("moe_latent_tail", "cuda", "symm_oneshot_triton", _ok_tail)
def _tail(y, topk_w, shared_partial, g_latent, w_up, eps, rank, group, prefetch, rounding=0):
    M, topk, L = y.shape
    rnd = rnd_bits(rounding)
    ok, peers = _peers(group, y.device, M * L * y.element_size(), "moe_latent_tail", M)
    if not ok:  # NCCL path: finalize, NCCL all-reduce, our norm kernel, addmm into a copy
        routed = _nccl_all_reduce_((y.float() * topk_w.unsqueeze(-1)).sum(1).to(y.dtype), group)
        _, ln = ar_residual_norm(routed, None, None, g_latent, None, None, [], eps, None, rnd)
        return add_up_shard(shared_partial.clone(), ln, w_up, rank)
    return moe_tail(y, topk_w, peers, shared_partial, g_latent, w_up, eps, rank, _prefetcher(prefetch), rnd)


def _ok_router(x, w_router, w_down, rank, tp, group, router_fp32=False, after_trigger=False):
    return (not router_fp32 and x.dim() == 2 and x.dtype in FLOAT and w_router.dtype == x.dtype and w_down.dtype == x.dtype
            and bool(group) and (w_router.shape[0] + w_down.shape[0]) % tp == 0)


def _ok_router1(x, w_router, w_down, rank, tp, group, router_fp32=False, after_trigger=False):
    return (not router_fp32 and tp == 1 and not group and x.dim() == 2 and x.dtype in FLOAT and w_router.dtype == x.dtype
            and w_down.dtype == x.dtype and w_router.shape[1] == w_down.shape[1] == x.shape[1])


@register("router_latent_sharded", "cuda", "one_gemm_triton", _ok_router1)
def _router1(x, w_router, w_down, rank, tp, group, router_fp32=False, after_trigger=False):
    return router_latent_one(x, w_router, w_down, after_trigger)


@register("router_latent_sharded", "cuda", "symm_allgather_triton", _ok_router)
def _router(x, w_router, w_down, rank, tp, group, router_fp32=False, after_trigger=False):
    S = (w_router.shape[0] + w_down.shape[0]) // tp
    ok, peers = _peers(group, x.device, x.shape[0] * S * x.element_size(), "router_latent_sharded", x.shape[0])
    if not ok or peers.world != tp or peers.rank != rank:
        # above the one-shot range the replicated GEMMs are faster than any gather
        return torch.mm(x, w_router.t()), torch.mm(x, w_down.t())
    return router_latent(x, w_router, w_down, peers)


def _ok_ar(x, group, prefetch):
    return x.dim() == 2 and x.dtype in FLOAT and x.is_contiguous() and bool(group)


@register("all_reduce_prefetch", "cuda", "symm_oneshot_triton", _ok_ar)
def _all_reduce(x, group, prefetch):
    ok, peers = _peers(group, x.device, x.numel() * x.element_size(), "all_reduce_prefetch", x.shape[0])
    if not ok:
        return _nccl_all_reduce_(x.clone(), group)
    return all_reduce(x, peers, _prefetcher(prefetch))
