"""Launchers of the Triton communication kernels, independent of where the peers' buffers live.

`Peers` names this rank's view of a symmetric buffer: every rank's address, every rank's signal
pad, this rank's index and the world size. On the GPU it comes from `runtime.symm.Workspace`;
CPU tests (TRITON_INTERPRET=1) build one from ordinary tensors to simulate the other ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import choose
from . import triton_cols as KC
from . import triton_comm as K
from ..runtime.symm import MAX_PROGRAMS
from ..config import knob, knob_flag
from ..ops import reference as _ref

_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
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
# AR_PRELOAD: the all-reduce / norm kernel loads the first four AttnRes block rows together before
# reducing them (triton_comm._ar_pre; the same values, errors 0 against the reference on the H200).
# One H200, simulated peers (bench/results/comm_sim_resnorm_b{3,7}_h200_9a1fa9c.json): the
# layer-input op with 3 blocks 6.5-6.8 vs 6.7-7.0 us at world 1, M = 1..16; at group size 8 27.2 /
# 28.9 / 29.2 vs 27.1 / 31.0 / 31.0 us (M = 1 / 4 / 16); 7 blocks 0.3-0.5 us faster. K3_KNOBS=ar_preload=0: the
# kernel before (each block row loaded just before it is reduced).
AR_PRELOAD = knob("ar_preload", "1") == "1"
# AR_LEAN: the same kernel holding fewer fp32 rows in registers (triton_comm.ar_residual_norm_kernel's
# LEAN: g and the AttnRes query loaded where used, the residual row in the model dtype); None = by
# group size (_ar_form), True / False = always / never (K3_KNOBS=ar_lean=1 / 0). ptxas (sm_90a, 8 warps, 3
# AttnRes blocks): spills per thread at group size 8 3.2 KB -> 0.7 KB, at 2 108 -> 56 bytes. One H200,
# simulated peers, 3 blocks (bench/comm_sim_bench.py AR_VARIANTS; BENCHMARKS.md), us, lean / not:
# group size 8, layer-input op M = 1 / 16: 26.2 / 27.9, 16.4 / 29.3; o-proj op
# 38.3 / 37.9, 25.4 / 44.1; group size 2 and 1 it was 0.2-1.0 us slower (10.5 / 10.1, 7.3 / 6.6 at M=1).
# AR_WARPS_M1: the warps at group size >= 8 and one row (M=1): 22.5 (16 warps) vs 26.2 (8) for the
# layer-input op, 31.6 vs 38.3 for the o-proj op; at M=16 16 warps were slower (25.1 vs 16.4). Now
# 32, with the joint reductions (AR_JOINT below).
AR_LEAN = {"1": True, "0": False}.get(knob("ar_lean"))
# AR_JOINT: the kernel's AttnRes sources four at a time, their sums of squares in one reduction and
# their logits in a second (triton_comm._mix4), and at group size 1 the updated row among them
# (_ar_row_w1: 3 reductions with up to 3 blocks, not 9). None = at group size 1 only (_ar_form); K3_KNOBS=ar_joint=1 /
# 0: always / never. One H200, simulated peers, 3 AttnRes blocks (comm_sim_bench AR_VARIANTS k3_seq;
# bench/results/comm_sim_ar_joint_h200_679bc84.json), us, joint / one by one: group size 1, layer-input op
# M = 1 / 4 / 16: 5.47 / 6.63, 5.77 / 6.77, 5.81 / 6.76; o-proj op 13.25 / 14.60 at M=1. Group size 8 (lean):
# M=1 22.4 / 22.7, but M = 4 / 16 26.0 / 15.9 and 26.7 / 16.6 (o-proj 38.7 / 24.7 at M=4): slower there.
# At group size 8 and one row, joint with 32 warps (AR_WARPS_M1) was faster than any other form
# (comm_sim_ar_w8_h200_a57f020.json), us, layer-input op / o-proj op: 15.5 / 23.7 against 22.4 / 31.3 (lean,
# 16 warps, one by one: the form before), 23.3 / 31.2 one by one with 32 warps, 22.5 / 31.2 joint with 16;
# the same in comm_sim_ar_joint_h200_679bc84.json (15.4 / 23.6). Simulated peers: no NVLink trip in these times.
AR_JOINT = {"1": True, "0": False}.get(knob("ar_joint"))
AR_LEAN_MIN_WORLD, AR_WARPS_M1 = 4, 32
# COLS: the column-split forms of the all-reduce / norm and latent-tail kernels (triton_cols) at
# M <= COLS_MAX_M and group size >= COLS_MIN_WORLD: each program takes COLS_W columns of every row and
# the rows' reductions are exchanged once between the programs. Read at launch, for bench variants:
# K3_KNOBS=cols=0 / 1 (the row kernels / this form at any group size), K3_KNOBS cols_max_m, K3_KNOBS cols_w.
# COLS_MAX_PROGRAMS keeps the grid barrier's programs all resident. One H200, simulated peers
# (`bench/gpu_steps.sh cols`, bench/results/comm_sim_cols_h200_f1f0e95.json), us, columns /
# rows at M=1: group size 8: layer-input op 9.9 / 15.6, o-proj op (GEMM included) 18.6 / 23.8, latent
# tail (+ up GEMM) 13.3 / 15.6; group size 1: 6.5 / 5.2, 15.1 / 13.3, 10.4 / 10.6. At M=4 and at 256
# columns per program the AttnRes form took 80-700 us (spills: COLS_MAX_TILE below), so: M=1, group
# size >= 2.
COLS, COLS_MIN_WORLD, COLS_MAX_M, COLS_W, COLS_MAX_PROGRAMS = True, 2, 1, 128, 64
# COLS_MAX_TILE: the most elements of the [rows, sources, columns] tile one program holds. On the GPU
# machine's Triton 3.6 the AttnRes form at 512 (one row, 4 sources, 128 columns) compiled to 168
# registers without spills, at 1024 and more to 32 registers and 1.4-5.3 KB of spills per thread, and
# took 82-707 us (bench/cols_probe.py, bench/results/cols_probe_h200_41ffe02.json; with the
# grid barrier skipped still 16-615 us): beyond it (e.g. 5-8 AttnRes sources at 7168 columns, which
# would need more than COLS_MAX_PROGRAMS programs) the row kernels run.
COLS_MAX_TILE = 512
COLS_PROBE: dict = {}   # bench/cols_probe.py only: GEN / SYNC of the column-split kernels
AR_W1_FIRST = True  # group size 1 (joint): the row's loads all before its store (triton_comm._ar_row_w1)


def _ar_form(world: int, M: int, block: int) -> tuple[bool, int, bool]:
    """(LEAN, num_warps, JOINT) of ar_residual_norm_kernel for a group size, rows and row width
    (AR_LEAN, AR_WARPS, AR_JOINT)."""
    lean = AR_LEAN if AR_LEAN is not None else world >= AR_LEAN_MIN_WORLD
    one_row_w8 = world >= 8 and M == 1 and block == 8192
    joint = AR_JOINT if AR_JOINT is not None else world == 1 or one_row_w8
    if AR_WARPS:
        return lean, AR_WARPS, joint
    return lean, AR_WARPS_M1 if one_row_w8 else _warps(block), joint


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
    on = knob_flag("cols", COLS and (peers.world if peers is not None else 1) >= COLS_MIN_WORLD)
    if not on or M < 1 or M > int(knob("cols_max_m") or COLS_MAX_M) or sources > 8 or N < 64:
        return None
    rows = triton.next_power_of_2(M)
    s_pad = max(2, triton.next_power_of_2(sources))
    cap = min(COLS_MAX_PROGRAMS, peers.programs if peers is not None else COLS_MAX_PROGRAMS)
    w = max(32, triton.next_power_of_2(int(knob("cols_w") or COLS_W)))
    while w > 32 and rows * s_pad * w > COLS_MAX_TILE:   # the [rows, sources, w] tile a program holds
        w //= 2
    programs = triton.cdiv(N, w)
    if programs < 2 or programs > cap or rows * s_pad * w > COLS_MAX_TILE or \
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
        ws = _off_thread(lambda: torch.zeros(64 + _COLS_SLOTS, dtype=torch.int32, device=device), device)
        _COLS_WS[device] = ws
    return ws[:64], ws[64:].view(torch.float32)


def _phases(device: torch.device) -> tuple[int, ...]:
    """One launch with the grid barrier on the GPU; two at the barrier where programs run one after
    another (the interpreter)."""
    return (0,) if device.type == "cuda" else (1, 2)


def rnd_bits(rounding: int = 0, mix_rounding: int = 0) -> int:
    """The communication kernels' RND constexpr (triton_comm's docstring) from the ops' rounding
    arguments (ops/reference.py's NORM_* / MIX_* bits): bit 0 the post-norm's NORM_CAST_FIRST, bit 1
    MIX_KEY_FP32. The other bits are fp32-rounding-level spellings (rsqrt / div / reciprocal, softmax
    or unrolled), which the kernels' fp32 math does not tell apart; the ops' registrations (cuda.py)
    decline what the kernels cannot follow."""
    return (1 if rounding & _ref.NORM_CAST_FIRST else 0) | (2 if mix_rounding & _ref.MIX_KEY_FP32 else 0)


def ar_residual_norm(local: torch.Tensor | None, peers: Peers | None, residual: torch.Tensor | None,
                     g: torch.Tensor | None, w_norm, w_qk, blocks: list[torch.Tensor], eps: float,
                     pushed: tuple[int, int, torch.dtype] | None = None, rnd: int = 0):
    """(updated, normed): updated = residual + sum_ranks(local); normed as the o-proj op (empty
    when g is None). `local` is this rank's [M, N] partial; peers None means TP=1.
    pushed = (M, N, dtype): the partials are already in the buffers (the CuTe push GEMM ran);
    `local` is None. rnd: the rounding order (rnd_bits)."""
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
            KC.ar_norm_cols_kernel[(plan.programs,)](
                peers.ptrs if peers else local, peers.pads if peers else local, peers.epoch if peers else local,
                peers.half(dt) if peers else 0, local, residual if residual is not None else local, upd, nrm, g,
                w_norm if w_norm is not None else g, w_qk if w_qk is not None else g, *bs, bar, slots, M, N, eps,
                RANK=peers.rank if peers else 0, WORLD=peers.world if peers else 1, NB=len(blocks),
                HAS_RES=residual is not None, ROWS=plan.rows, W=plan.w, S_PAD=plan.s_pad, P_PAD=plan.p_pad,
                DTYPE=_TL[dt], SEQ=SEQ_BARRIER, VEC=COMM_VEC, PHASE=phase, RND=rnd, num_warps=4, **COLS_PROBE)
        return upd, nrm
    BLOCK = triton.next_power_of_2(N)
    lean, warps, joint = _ar_form(peers.world if peers else 1, M, BLOCK)
    # at TP=1 with a norm: one program per row, so the GEMV after it may stream its weights meanwhile
    trigger = peers is None and g is not None and pushed is None and gemv_pdl(local.device) is not None
    K.ar_residual_norm_kernel[(_programs(M, peers),)](
        peers.ptrs if peers else local, peers.pads if peers else local, peers.epoch if peers else local,
        peers.half(dt) if peers else 0, local,
        residual if residual is not None else local, upd, nrm,
        g if g is not None else local, w_norm if w_norm is not None else local,
        w_qk if w_qk is not None else local, *bs, M, N, eps, peers.flag_off if pushed else 0, triton.cdiv(N, 64),
        RANK=peers.rank if peers else 0, WORLD=peers.world if peers else 1, NB=len(blocks),
        HAS_NORM=g is not None, HAS_RES=residual is not None, BLOCK_N=BLOCK, DTYPE=_TL[dt], SEQ=SEQ_BARRIER,
        PUSHED=pushed is not None, PRELOAD=AR_PRELOAD, LEAN=lean, JOINT=joint, W1_FIRST=AR_W1_FIRST,
        TRIGGER=trigger, RND=rnd, num_warps=warps, **_comm())
    if trigger:
        _note_trigger(nrm)
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
            KC.latent_tail_cols_kernel[(plan.programs,)](
                y, topk_w.contiguous(), peers.ptrs if peers else ln, peers.pads if peers else ln,
                peers.epoch if peers else ln, peers.half(dt) if peers else 0, g, ln, shared_partial, out, bar, slots,
                M, L, SP, eps, TOPK=TOPK, RANK=peers.rank if peers else 0, WORLD=peers.world if peers else 1,
                ROWS=plan.rows, W=plan.w, WSP=triton.next_power_of_2(triton.cdiv(SP, plan.programs)),
                P_PAD=plan.p_pad, DTYPE=_TL[dt], SEQ=SEQ_BARRIER, VEC=COMM_VEC, PHASE=phase, RND=rnd, num_warps=4,
                **COLS_PROBE)
        return ln, out
    BLOCK = triton.next_power_of_2(L)
    K.latent_tail_kernel[(_programs(M, peers),)](
        y, topk_w.contiguous(), peers.ptrs if peers else ln, peers.pads if peers else ln,   # ln: unread at TP=1
        peers.epoch if peers else ln, peers.half(dt) if peers else 0,
        g, ln, shared_partial, out, M, L, SP, eps,
        TOPK=TOPK, RANK=peers.rank if peers else 0, WORLD=peers.world if peers else 1,
        BLOCK_N=BLOCK, BLOCK_SP=triton.cdiv(SP, 1024) * 1024, DTYPE=_TL[dt], SEQ=SEQ_BARRIER, RND=rnd,
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
    K.gather_router_latent_kernel[(_programs(triton.cdiv(M * (E + L), BLOCK), peers),)](
        peers.ptrs, peers.pads, peers.epoch, peers.half(shard.dtype), shard, router, latent, M, S, E, L,
        RANK=peers.rank, WORLD=peers.world, BLOCK=BLOCK, DTYPE=_TL[shard.dtype], SEQ=SEQ_BARRIER,
        VEC=COMM_VEC, num_warps=4)
    return router, latent


def l2_prefetch(t: torch.Tensor, lanes: int = 128) -> None:
    nbytes = t.numel() * t.element_size()
    if nbytes < 4096:
        return
    K.l2_prefetch_kernel[(triton.cdiv(nbytes // 4096, lanes),)](t.view(-1).view(torch.uint8), nbytes,
                                                                LANES=lanes, num_warps=lanes // 32)


# ------------------------------------------------------------------ whole ops (device-agnostic)
def _no_prefetch():
    return lambda: None


def oproj(x, w, peers: Peers | None, residual, blocks, w_norm, w_qk, g, eps, start_prefetch=_no_prefetch,
          push=None, rnd: int = 0):
    """The o-proj op: GEMM, then the all-reduce + residual + norm kernel. `start_prefetch()`
    runs between the two and returns the function that joins the prefetch. push: the CuTe
    push-epilogue GEMM artifact (choose.push_gemm): the GEMM stores this rank's partial into every
    rank's buffer and flags it, and the kernel after it reads only this rank's buffer. rnd: the
    rounding order (rnd_bits)."""
    if push is not None:
        push.launch_push(x.contiguous(), w.contiguous(), peers, peers.flag_off)
        pushed = (x.shape[0], w.shape[0], x.dtype)
        part = None
    else:
        part = choose.gemm("oproj", x, w)  # CuTe where kernels/choose.py says so, else torch.mm
        pushed = None
    join = start_prefetch()
    upd, nrm = ar_residual_norm(part, peers, residual, g, w_norm, w_qk, list(blocks), eps, pushed, rnd)
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
    choose.gemm_add_(out if n == out.shape[-1] else out[:, rank * n:(rank + 1) * n], ln, w_up)
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
    w = _off_thread(lambda: torch.cat([w_router[a:], w_down[:S - S1]]), w_router.device)
    _RANK_ROWS[key] = (weakref.ref(w_router), weakref.ref(w_down), ver, w)
    weakref.finalize(w_router, _RANK_ROWS.pop, key, None)  # the copy goes with the weights
    return w


def _off_thread(make, device: torch.device):
    """make() on a helper thread, for a tensor kept across calls: during a CUDA-graph-trees warm-up
    (mode="reduce-overhead") every allocation of the calling thread goes to the graph's private
    pool, and a kept tensor there is an untracked live allocation (cudagraph_trees refuses it).
    On CUDA the helper waits for its stream, so the result is ready when this returns."""
    if device.type != "cuda":
        return make()
    import threading
    out: list = []

    def run():
        try:
            with torch.cuda.device(device):
                out.append(make())
                torch.cuda.current_stream(device).synchronize()
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            out.append(e)
    torch.cuda.current_stream(device).synchronize()  # the weights' last writes, if any, are done
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _two_weight_cfg(x, w1, w2, rows: int) -> "MmaCfg | tuple | None":
    """The tuned config of a [rows, K] weight at x's M, for mma_gemm2 over rows of w1 and w2: an MMA
    config, or a CUDA-core GEMV one at M <= GEMV_MAX_M (None: cuBLAS in the table, or an operand not
    unit-stride along K)."""
    cfg = choose.gemv_plan(x, w1, rows=rows)
    ok = (isinstance(cfg, MmaCfg) or (cfg is not None and x.shape[0] <= GEMV_MAX_M)) and x.stride(1) == 1 \
        and w1.stride(1) == 1 and w2.stride(1) == 1
    return cfg if ok else None


def _cfg_bn(cfg) -> int:
    """The rows per program of an MMA or CUDA-core GEMV config."""
    return cfg.bn if isinstance(cfg, MmaCfg) else cfg[0]


def router_latent_shard(x, w_router, w_down, tp: int, rank: int) -> torch.Tensor:
    """This rank's rows of [W_r; W_down] times x: [M*S], row-major [M, S] (router columns first).
    The rank whose rows straddle both weights runs one launch of the MMA GEMM over its rows of each
    (mma_gemm2, no copy) where the tuned table has [S, K] at this M and its router rows are a multiple
    of the config's BN; otherwise one GEMM over the kept copy (rank_rows)."""
    S, a, S1 = router_latent_split(w_router.shape[0], w_down.shape[0], tp, rank)
    if 0 < S1 < S:
        cfg = _two_weight_cfg(x, w_router, w_down, S)
        if cfg is not None and S1 % _cfg_bn(cfg) == 0:
            out = torch.empty(x.shape[0], S, dtype=x.dtype, device=x.device)
            mma_gemm2(x, w_router[a:], w_down[:S - S1], cfg, out1=out[:, :S1], out2=out[:, S1:])
            return out.view(-1)
    w = rank_rows(w_router, w_down, tp, rank)
    if w is not None:
        return choose.gemm("router_shard", x, w).view(-1)
    return torch.cat([torch.mm(x, w_router[a:].t()), torch.mm(x, w_down[:S - S1].t())], 1).view(-1)


def router_latent_one(x, w_router, w_down):
    """TP=1: (x @ W_r.T, x @ W_down.T) in one launch of the MMA decode GEMM over the stacked rows
    (mma_gemm2; the MMA or the CUDA-core GEMV kernel) where the tuned table has the stacked shape
    [E + L, K] at this M; else each GEMM
    through choose.gemm (its own tuned config, or cuBLAS)."""
    cfg = _two_weight_cfg(x, w_router, w_down, w_router.shape[0] + w_down.shape[0])
    if cfg is not None:
        return mma_gemm2(x, w_router, w_down, cfg)
    return choose.gemm("router", x, w_router), choose.gemm("latent", x, w_down)


def router_latent(x, w_router, w_down, peers: Peers):
    """The sharded router + latent op: this rank's shard, then the all-gather kernel."""
    shard = router_latent_shard(x, w_router, w_down, peers.world, peers.rank)
    return gather_router_latent(shard, peers, x.shape[0], w_router.shape[0], w_down.shape[0])


GEMV_MAX_M = 8
# (BLOCK_N, BLOCK_K, num_warps, num_stages) of triton_gemv where no tuned config is given
# (choose.GEMV_TABLE has the measured ones); a fifth element 1 asks for the LAZY form ("gemvl" names)
GEMV_DEFAULT = (8, 512, 4, 3)
# LAZY's [MP, BLOCK_N, BLOCK_K] fp32 tile at most this many registers a thread, else the plain form
GEMV_LAZY_REGS = 64


def gemv_parts(cfg: tuple, mp: int) -> tuple[int, int, int, int, bool]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, lazy) of a CUDA-core GEMV config at MP (a power of two
    >= M) token rows: lazy where the config asks for it and its accumulator tile fits GEMV_LAZY_REGS."""
    bn, bk, nw, ns, *rest = cfg
    lazy = bool(rest and rest[0]) and mp * bn * bk <= GEMV_LAZY_REGS * 32 * nw
    return bn, bk, nw, ns, lazy


def gemv_name(cfg: tuple) -> str:
    """A CUDA-core GEMV config's name as choose.parse_cfg reads it back ("gemv[l] BN/BK/warps/stages")."""
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
        _SPLIT[key] = (_off_thread(lambda: torch.zeros(SPLIT_SLOTS * SPLIT_STREAMS, dtype=torch.int32,
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
    from . import triton_gemv as KG
    H, M, K = x.shape
    N = w.shape[1] if w_nk else w.shape[2]
    out = torch.empty(M, H, N, dtype=x.dtype, device=x.device).permute(1, 0, 2)
    g = gate if gate is not None else out
    swk, swn = (w.stride(2), w.stride(1)) if w_nk else (w.stride(1), w.stride(2))
    BN = max(16, min(128, triton.next_power_of_2(triton.cdiv(H * N, 96))))
    BK = max(16, min(128, triton.next_power_of_2(K)))
    if M:
        KG.head_bmm_kernel[(H, triton.cdiv(N, BN))](
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
              out1: torch.Tensor | None = None, out2: torch.Tensor | None = None):
    """(x @ w1.t(), x @ w2.t()) in ONE launch of the MMA GEMM over the stacked rows [w1; w2] (no copy
    of either weight; `cfg` is the stacked shape's); both weights [*, K] of x's dtype with unit stride
    along K, the outputs [M, N1] / [M, N2] (given: unit stride along N; e.g. two column ranges of one
    buffer). Returns (out1, out2). Where w1's rows are not a multiple of the config's BN (a program's
    rows must lie in one weight), two launches of the same config instead. A CUDA-core GEMV config
    (a tuple, M <= GEMV_MAX_M) runs the same way on gemv_kernel (TWO)."""
    M = x.shape[0]
    if w1.shape[1] != w2.shape[1] or w1.dtype != w2.dtype:
        raise ValueError(f"mma_gemm2: weights {tuple(w1.shape)} {w1.dtype} and {tuple(w2.shape)} {w2.dtype} "
                         "must share K and dtype")
    out1 = torch.empty(M, w1.shape[0], dtype=x.dtype, device=x.device) if out1 is None else out1
    out2 = torch.empty(M, w2.shape[0], dtype=x.dtype, device=x.device) if out2 is None else out2
    if not isinstance(cfg, MmaCfg):
        _gemv2(x, w1, w2, out1, out2, cfg)
        return out1, out2
    if w1.shape[0] % cfg.bn:
        _mma(x, w1, out1, None, None, cfg, False)
        _mma(x, w2, out2, None, None, cfg, False)
    else:
        _mma(x, w1, out1, w2, out2, cfg, False)
    return out1, out2


def _gemv2(x, w1, w2, out1, out2, cfg: tuple) -> None:
    """mma_gemm2's CUDA-core form: one gemv_kernel launch over the stacked rows (TWO), or two launches
    where w1's rows are not a multiple of BLOCK_N."""
    M = x.shape[0]
    if M > GEMV_MAX_M:
        raise ValueError(f"the CUDA-core GEMV takes M <= {GEMV_MAX_M} tokens, got {M}")
    if w1.shape[0] % cfg[0]:
        gemv(x, w1, out1, cfg=cfg)
        gemv(x, w2, out2, cfg=cfg)
    else:
        _gemv_launch(x, w1, out1, cfg, two=(w2, out2))


# GEMV_PDL_PF: bytes of each program's weight rows the CUDA-core GEMV requests into L2 before its PDL wait, by
# weight shape, where the GEMV reads the output of the one-program TP=1 all-reduce / norm kernel (which lets it
# launch at its start: TRIGGER). One H200, bench/pdl_probe.py (bench/results/pdl_probe_h200_51d35a4.json),
# norm + GEMV pair, us, no PDL / PDL alone / 8 / 16 / 32 / 64 KiB: MLA qkv_a (gemvl 4/1024/4/3) 19.82 / 19.86 /
# 17.15 / 17.11 / 18.39 / 21.15; KDA in_proj (gemvl 8/512/4/3) 28.47 / 28.44 / 25.70 / 25.52 / 26.67 / 29.22; the
# stacked router + latent (gemvl 2/1024/4/4, 2240 programs) 24.00 / 23.86 / 24.99 / 25.20 / 26.93 / 26.41: slower,
# so not in the table. PDL with no prefetch gains nothing, and a GEMV launched with PDL after a kernel that does not
# trigger (the MLA q_b after Inductor's norm) took 5.44 us against 4.77 in the layer: only the pair gets it.
# One H100, the same probe (pdl_probe_h100_f41d0ef.json), us, no PDL / 8 / 16 / 32 / 64 KiB: qkv_a 24.77 /
# 20.06 / 19.83 / 21.59 / 24.23, in_proj 37.19 / 32.94 / 32.62 / 33.74 / 34.86, router + latent 28.74 / 27.06 /
# 28.27 / 30.40 / 29.64 (the H200 runs these three on the MMA GEMM, where no PDL applies). In the layers at M=1
# (layer_{kda,mla}_tp8_w1_h100_f41d0ef_pdl.json), us with the launch hidden, no PDL / qkv_a and in_proj at 16 KiB:
# KDA 138.8 / 135.2, MLA 139.4 / 135.1, every round of the second below every round of the first. With the router +
# latent at 8 KiB too (layer_*_h100_843c313_pdl1.json; no PDL / without that entry / this table): KDA
# 139.0 / 135.2 / 132.4, MLA 139.4 / 134.9 / 132.5; M = 4 and 16 (MMA GEMMs there) unchanged within 0.4 us.
GEMV_PDL_PF = {(3648, 7168): 16384, (6284, 7168): 16384, (4480, 7168): 8192}
GEMV_PDL_DEFAULT = True   # GEMV_PDL_PF applied with K3_KNOBS gemv_pdl unset
_TRIGGERED: dict[int, int] = {}   # CUDA stream -> data_ptr of the last triggering norm kernel's normed output


def gemv_pdl(device: torch.device, shape: tuple[int, int] | None = None) -> int | None:
    """The L2 prefetch bytes of a PDL GEMV launch (0: PDL without prefetch), or None: no PDL. K3_KNOBS gemv_pdl (read at
    each launch, so a benchmark variant can set it while it compiles and captures): "off" = never; "on" =
    GEMV_PDL_PF's bytes for this weight shape (none for a shape not in it); a number = that many bytes for every
    shape; unset = "on" if GEMV_PDL_DEFAULT else "off". CUDA on Hopper or later only. With shape=None: whether
    PDL is on at all (the norm kernel's TRIGGER)."""
    return _pdl_choice("gemv_pdl", GEMV_PDL_DEFAULT, _pdl_table(knob("gemv_pdl_pf")), device, shape)


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
        return GEMV_PDL_PF
    out = {}
    for part in text.split(";"):
        shape, _, nbytes = part.partition("=")
        n, _, k = shape.partition("x")
        out[(int(n), int(k))] = int(nbytes)
    return out


def _note_trigger(nrm: torch.Tensor) -> None:
    """A kernel that triggers its dependents (the TP=1 norm) wrote `nrm`: the GEMV reading it next is its PDL
    secondary."""
    _TRIGGERED[torch.cuda.current_stream(nrm.device).cuda_stream] = nrm.data_ptr()


def _after_trigger(x: torch.Tensor) -> bool:
    """Whether x is the normed output of the last triggering norm kernel launched on this stream. The first
    decode GEMM launched after that kernel takes the mark either way, so a later GEMM whose input happens
    to reuse the same memory is not taken for its secondary."""
    if not _TRIGGERED or not x.is_cuda:
        return False
    return _TRIGGERED.pop(torch.cuda.current_stream(x.device).cuda_stream, None) == x.data_ptr()


def _pdl_rows_ok(w: torch.Tensor, K: int | None = None) -> bool:
    """A weight whose rows are contiguous and 16-byte aligned (the L2 prefetch's); with K, also packed one after
    another (stride K: the GEMV requests a program's rows as one slice)."""
    return (w.stride(1) == 1 and w.data_ptr() % 16 == 0 and (w.stride(0) * w.element_size()) % 16 == 0
            and (K is None or w.stride(0) == K))


def _gemv_launch(x, w, out, cfg: tuple, accumulate: bool = False, pdl: bool = False, two=None) -> None:
    """One gemv_kernel launch (gemv's and, with two=(w2, out2): the rows of w then w2, _gemv2's)."""
    from . import triton_gemv as KG
    M, K = x.shape
    if not M:
        return
    bn, bk, nw, ns, lazy = gemv_parts(cfg, triton.next_power_of_2(M))
    pf = 0
    if _after_trigger(x) and not pdl and K >= bk:
        auto = gemv_pdl(x.device, (w.shape[0] + (two[0].shape[0] if two else 0), K))
        if auto is not None:
            pdl = True
            rows_ok = _pdl_rows_ok(w, K) and (two is None or _pdl_rows_ok(two[0], K))
            pf = auto if rows_ok else 0
    w2, out2 = two or (w, out)
    N1 = w.shape[0]
    N = N1 + (w2.shape[0] if two else 0)
    KG.gemv_kernel[(triton.cdiv(N, bn),)](x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
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
    from . import triton_gemv as KG
    M, K = x.shape[0], w.shape[1]
    N1 = w.shape[0]
    N = N1 + (w2.shape[0] if w2 is not None else 0)
    if M > MMA_MAX_M:
        raise ValueError(f"mma_gemm takes M <= {MMA_MAX_M} tokens, got {M}")
    if not M:
        return
    two = w2 is not None
    _after_trigger(x)   # the first decode GEMM after the TP=1 norm takes its mark (the GEMV's PDL pair)
    tiles, split, cnt, part = _split_plan(out, N, K, cfg, MMA_MAX_M * cfg.bn)
    KG.mma_gemm_kernel[(tiles, split)](x, w, out, part, cnt, M, N, K, x.stride(0), w.stride(0), out.stride(0),
                                       w2 if two else w, out2 if two else out, N1,
                                       w2.stride(0) if two else 0, out2.stride(0) if two else 0,
                                       BM=MMA_MAX_M, BN=cfg.bn, BK=cfg.bk, SPLIT=split, SWAP=cfg.swap,
                                       EVEN_K=K % cfg.bk == 0, ACC=accumulate, TWO=two,
                                       num_warps=cfg.warps, num_stages=cfg.stages)


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False,
         cfg: "tuple[int, int, int, int] | MmaCfg | None" = None, pdl: bool = False) -> torch.Tensor:
    """x @ w.t() (into `out`, or added to it with accumulate=True) by the Triton GEMV, M <= 8, or,
    for an MmaCfg, by the tensor-core split-K kernel (mma_gemm, M <= 16);
    x [M, K] and w [N, K] with unit stride along K, out [M, N] with unit stride along N. pdl: launched
    with Programmatic Dependent Launch, the first weight tile read before waiting for the previous
    kernel (triton_gemv's docstring; an experiment, CUDA sm_90+ only, K >= the config's BLOCK_K)."""
    if isinstance(cfg, MmaCfg):
        if pdl:
            raise ValueError("the MMA GEMM has no PDL form")
        return mma_gemm(x, w, cfg, out, accumulate)
    M, K = x.shape
    if out is None:
        out = torch.empty(M, w.shape[0], dtype=x.dtype, device=x.device)
    cfg = cfg or GEMV_DEFAULT
    if pdl and K < cfg[1]:
        raise ValueError(f"gemv(pdl=True) needs K >= BLOCK_K (K={K}, BLOCK_K={cfg[1]})")
    _gemv_launch(x, w, out, cfg, accumulate, pdl)
    return out


def situ(gate_up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """model.functional.situ of a 2-D contiguous [M, 2I] tensor in one Triton kernel."""
    from . import triton_moe as KM
    M, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(M, I, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    if M and I:
        KM.situ_kernel[(M, triton.cdiv(I, BLOCK))](gate_up, out, M, I, float(beta), float(linear_beta), BLOCK=BLOCK,
                                                    num_warps=4)
    return out


def situ_mlp(x, w_gate_up, w_down, beta: float, linear_beta: float) -> torch.Tensor:
    """The shared expert (model.functional.situ_mlp's math): GEMM, the SiTU kernel, GEMM."""
    gu = choose.gemm("shared_gate_up", x, w_gate_up)
    return choose.gemm("shared_down", situ(gu, beta, linear_beta), w_down)


def situ_mlp2(x, w_gate, w_up, w_down, beta: float, linear_beta: float) -> torch.Tensor:
    """The shared expert with separate gate and up weights: both GEMMs into one [M, 2I] buffer, the
    SiTU kernel, the down GEMM."""
    x2 = x.reshape(-1, x.shape[-1])
    gu = torch.cat([choose.gemm("shared_gate_up", x2, w_gate), choose.gemm("shared_gate_up", x2, w_up)], -1)
    out = choose.gemm("shared_down", situ(gu, beta, linear_beta), w_down)
    return out.reshape(*x.shape[:-1], w_down.shape[0])


ROUTER_TOPK_MAX_E = 4096  # one row in one program's registers


# the router top-k's selection: Triton's bitonic top-k (tl.topk over the packed keys, one pass, 8 warps)
# instead of k max-reduction rounds (4 warps); K3_KNOBS=router_sort=0/1 overrides. One H200, E = 896, top-16
# (bench/router_bench.py, bench/results/router_topk_h200_82d2ce6.json), us at M = 1 / 4 / 16:
# rounds 4 warps 5.24 / 5.24 / 5.27; bitonic 4 warps 4.75 / 4.77 / 4.79, 8 warps 3.79 / 3.84 / 3.86,
# 16 warps 4.09 / 4.09 / 4.13. (E > 1024 not measured; those take 16 warps bitonic, 8 by rounds.)
ROUTER_SORT = True


def _router_sort() -> bool:
    return knob_flag("router_sort", ROUTER_SORT)


def router_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, scale: float, ids_dtype=torch.int64,
                sort: bool | None = None):
    """(ids [M, k] of ids_dtype (int64 or int32), weights fp32 [M, k]) of the K3 router
    (triton_router's docstring)."""
    from . import triton_router as KR
    M, E = logits.shape
    ids = torch.empty(M, k, dtype=ids_dtype, device=logits.device)
    w = torch.empty(M, k, dtype=torch.float32, device=logits.device)
    if M:
        if sort is None:
            sort = _router_sort()
        KR.router_topk_kernel[(M,)](logits, bias, ids, w, E, float(scale), K=k, KP=triton.next_power_of_2(k),
                                    BLOCK=triton.next_power_of_2(E), SORT=sort,
                                    num_warps=(8 if E <= 1024 else 16) if sort else (4 if E <= 1024 else 8))
    return ids, w


# heads per program, cache rows per tile, programs aimed at, fewest cache rows per split, warps. A split's
# fp32 partial (H x L) costs as much to write and combine as 2 x H / (L + R) of its rows cost to read (at
# 12 heads and a 1025-row context, splits of 32 rows write 0.8 MB of partials for 1.2 MB of cache), yet
# more programs win at decode: one H200, 12 heads, context 1024 (bench/mla_bench.py,
# bench/results/mla_sweep_h200_917d221.json), us at M = 1 / 4 / 16, fewest rows 32 / 64 / 128 (4 warps):
# 10.0 / 11.0 / 14.3, 10.6 / 11.4 / 15.1, 24.4 / 24.4 / 24.1 (the op's PyTorch reference 61.2, 80.8,
# 184.2); 8 warps no better; tiles of 64 rows do not fit in shared memory.
MLA_BH, MLA_BS, MLA_PROGRAMS, MLA_MIN_CH, MLA_WARPS = 16, 32, 132, 32, 4
# columns of the latent per combine program where the (token, head) rows alone give fewer programs than
# MLA_PROGRAMS (a TP=8 rank at M=1 has 12 heads: 12 programs, each reading every split's [L] partial);
# 0: one program per row. MLA layer at TP=8 widths, one H200, replay timeline, combine kernel us at M = 1 /
# 4 / 16 with 0 / 64 / 128 columns: 4.16 / 3.10 / 4.61, 4.42 / 4.19 / 5.50, 1.98 / 4.06 / 3.68
# (bench/results/layer_mla_tp8_w1_h200_5854264_mlaout.json; M=16 has 192 rows: split there it is slower).
# K3_KNOBS mla_combine_bl overrides at every M (0: never split)
MLA_COMBINE_BL = 64


def mla_decode_fits(q_lat, q_rope, kv_new, kv_cache) -> bool:
    """Shapes the Triton MLA decode takes: [M, H, L] / [M, H, R] queries, an [M, S, L + R] cache with
    unit stride along its last dim, L and R powers of two >= 16, float dtypes."""
    if q_lat.dim() != 3 or q_rope.dim() != 3 or kv_cache.dim() != 3 or kv_new.dim() != 2:
        return False
    L, R = q_lat.shape[-1], q_rope.shape[-1]
    pow2 = lambda v: v >= 16 and v & (v - 1) == 0  # noqa: E731
    return (pow2(L) and pow2(R) and kv_cache.shape[-1] == L + R and kv_cache.stride(-1) == 1
            and q_lat.stride(-1) == 1 and q_rope.stride(-1) == 1
            and kv_cache.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and q_lat.dtype in (torch.bfloat16, torch.float16, torch.float32))


# value columns per program of the MLA combine + value up-projection kernel (K3_KNOBS mla_uv_bv overrides).
# MLA layer at TP=8 widths, one H200, 16 vs 32 columns, us at M = 1 / 4 / 16: 122.8 / 162.7 / 268.8 vs
# 122.0 / 161.0 / 270.1 (bench/results/layer_mla_tp8_w1_h200_ad84e26_fold.json): within noise
MLA_UV_BV = 16
# the combine + value up-projection with the split count a constant (triton_mla._combine_splits_flat;
# warps MLA_UV_WARPS), FLAT up to MLA_UV_FLAT_MAX_M tokens. K3_KNOBS mla_uv_flat (at every M) / K3_KNOBS mla_uv_warps
# override. MLA layer at TP=8 widths, one H200, us at M = 1 / 4 / 16
# (bench/results/layer_mla_tp8_w1_h200_a867659_pipe.json): default 125.9 / 158.8 / 267.0, FLAT 123.6 /
# 159.0 / 267.9 (combine kernel 5.15 -> 4.29 us at M=1)
MLA_UV_FLAT, MLA_UV_FLAT_MAX_M, MLA_UV_WARPS = True, 1, 4


def mla_decode(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale, kv_norm=None, uv=None) -> torch.Tensor:
    """k3model::mla_decode (one new token per row) by triton_mla: kv_cache[m, seq_lens[m]] = kv_new[m]
    (inside the split kernel), then attention of the M x H queries over positions 0..seq_lens[m] of
    their row; o [M, H, L] in q_lat's dtype. The caller validated the shapes
    (attention_ops.validate_mla) and mla_decode_fits. kv_norm=(w [L], eps): kv_new is the raw kv_a
    row, its first L columns RMS-normalised in the split kernel (k3::mla_decode_normed). uv=(W, w_nk,
    gate): the result is k3::decode_bmm(o.permute(1, 0, 2), W, w_nk, gate) instead of o ([H, M, V],
    stored token-major), the combine and the value up-projection in one kernel (k3::mla_decode_uv)."""
    from . import triton_mla as KA
    M, H, L = q_lat.shape
    R, S = q_rope.shape[-1], kv_cache.shape[1]
    if uv is not None:
        w, w_nk, gate = uv
        V = w.shape[1] if w_nk else w.shape[2]
        out = torch.empty(M, H, V, dtype=q_lat.dtype, device=q_lat.device)
    else:
        out = torch.empty(M, H, L, dtype=q_lat.dtype, device=q_lat.device)
    if M == 0:
        return out.permute(1, 0, 2) if uv is not None else out
    lens = seq_lens.to(device=kv_cache.device, dtype=torch.long)
    hb = triton.cdiv(H, MLA_BH)
    # splits of the cache capacity (the lengths are not known on the host under a CUDA graph):
    # about MLA_PROGRAMS programs, each at least one tile; a split past its row's length exits at once
    ch = max(MLA_MIN_CH, MLA_BS, triton.next_power_of_2(triton.cdiv(S, max(1, MLA_PROGRAMS // (M * hb)))))
    ns = triton.cdiv(S, ch)
    part_o = torch.empty(M, H, ns, L, dtype=torch.float32, device=q_lat.device)
    part_ml = torch.empty(M, H, ns, 2, dtype=torch.float32, device=q_lat.device)
    if kv_new.stride(-1) != 1:
        kv_new = kv_new.contiguous()
    KA.mla_split_kernel[(M, hb, ns)](q_lat, q_rope, kv_new, kv_cache, lens, part_o, part_ml, H, S, ch, ns, float(scale),
                                     q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1),
                                     kv_new.stride(0), kv_cache.stride(0), kv_cache.stride(1),
                                     kv_norm[0] if kv_norm else kv_new, float(kv_norm[1]) if kv_norm else 0.0,
                                     L=L, R=R, BH=MLA_BH, BS=MLA_BS, IEEE=kv_cache.dtype == torch.float32,
                                     NORM=kv_norm is not None,
                                     num_warps=MLA_WARPS)
    if uv is not None:
        swl, swv = (w.stride(2), w.stride(1)) if w_nk else (w.stride(1), w.stride(2))
        g = gate if gate is not None else out
        bv = int(knob("mla_uv_bv") or MLA_UV_BV)
        flat = knob_flag("mla_uv_flat", MLA_UV_FLAT and M <= MLA_UV_FLAT_MAX_M)
        KA.mla_combine_uv_kernel[(M, H, triton.cdiv(V, bv))](
            part_o, part_ml, w, g, out, H, ns, V, w.stride(0), swl, swv, g.stride(0), g.stride(1), g.stride(2),
            L=L, BNS=min(8, triton.next_power_of_2(ns)), BV=bv, GATE=gate is not None,
            NSC=ns if flat else 0, NSP=triton.next_power_of_2(ns) if flat else 1,
            num_warps=int(knob("mla_uv_warps") or MLA_UV_WARPS))
        return out.permute(1, 0, 2)
    flag = knob("mla_combine_bl")
    bl = int(flag) if flag else (MLA_COMBINE_BL if M * H < MLA_PROGRAMS else 0)
    bl = bl if bl and bl & (bl - 1) == 0 and L % bl == 0 else 0
    KA.mla_combine_kernel[(M, H, L // bl if bl else 1)](part_o, part_ml, out, H, ns, out.stride(0), out.stride(1), L=L,
                                                         BNS=min(16, triton.next_power_of_2(ns)), BL=bl, num_warps=4)
    return out


# channels per program of the KDA short conv (K3_KNOBS conv_block overrides; a power of two >= 32). KDA layer
# at TP=8 widths on one H200, k3 with 1024 / 256 / 128, us at M=1: 139.5 / 137.1 / 138.2 and
# 141.6 / 138.7 / 138.7 in two runs; M=4, 16 within 1 us (bench/results/layer_kda_tp8_w1_h200_*_{onegemm,tl}.json).
# 1024 gave a TP=8 rank's 4608 channels 5 programs at M=1, 256 gives 18
CONV_BLOCK = 256


def kda_conv_decode_fits(xq, xk, xv, state, w) -> bool:
    """Calls the Triton short conv takes: 2-D [M, C/3] inputs of one float dtype with unit stride
    along channels, state [M, C, KW - 1] and w [C, KW] (contiguous), 2 <= KW <= 8."""
    if xq.dim() != 2 or state.dim() != 3 or w.dim() != 2:
        return False
    M, cq = xq.shape
    C, kw = w.shape
    return (xk.shape == xq.shape == xv.shape and C == 3 * cq and 2 <= kw <= 8
            and tuple(state.shape) == (M, C, kw - 1) and w.is_contiguous()
            and all(t.stride(-1) == 1 for t in (xq, xk, xv))
            and xq.dtype in _TL and xk.dtype == xq.dtype == xv.dtype == state.dtype == w.dtype)


def kda_conv_decode(xq, xk, xv, state, w, inplace: bool = False):
    """k3::kda_conv_decode by triton_conv (the caller checked kda_conv_decode_fits): (q, k, v,
    new_state); inplace (k3::kda_conv_decode_): the new state is written into `state` (returned)."""
    from . import triton_conv as KC
    M, cq = xq.shape
    kw = w.shape[1]
    q, k, v = (torch.empty(M, cq, dtype=xq.dtype, device=xq.device) for _ in range(3))
    new_state = state if inplace else torch.empty(state.shape, dtype=state.dtype, device=state.device)
    BLOCK = int(knob("conv_block") or CONV_BLOCK)
    if M:
        KC.kda_conv_decode_kernel[(M, triton.cdiv(3 * cq, BLOCK))](
            xq, xk, xv, state, w, q, k, v, new_state, cq, xq.stride(0), xk.stride(0), xv.stride(0),
            state.stride(0), state.stride(1), state.stride(2), *new_state.stride(), KW=kw, BLOCK=BLOCK,
            num_warps=max(1, min(4, BLOCK // 32)))
    return q, k, v, new_state


# value columns per program of triton_kda (fla-core's fused_recurrent_kda uses 32 too)
KDA_FB_BV = 32


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _kda_fb_rest_fits(M, H, K, V, dtype, fa, f_b, beta, a_log, dt_bias, state) -> bool:
    """The checks of kda_decode_fb_fits past q, k, v (of shapes [M, H, K] / [M, H, V] and dtype `dtype`)."""
    R = fa.shape[-1] if fa.dim() == 2 else -1
    return (M > 0 and _pow2(K) and _pow2(V) and 16 <= K <= 256 and 16 <= V <= 256 and V % min(KDA_FB_BV, V) == 0
            and R > 0 and R % 8 == 0 and fa.shape[0] == M and fa.stride(1) == 1 and f_b.dim() == 2
            and tuple(f_b.shape) == (H * K, R) and f_b.is_contiguous() and dtype in _TL and fa.dtype == f_b.dtype == dtype
            and beta.dim() == 2 and tuple(beta.shape) == (M, H) and beta.stride(1) == 1 and beta.dtype in _TL
            and tuple(a_log.shape) == (H,) and a_log.is_contiguous() and dt_bias.numel() == H * K
            and dt_bias.is_contiguous() and tuple(state.shape) == (M, H, K, V) and state.dtype == torch.float32
            and state.is_contiguous() and len({t.device for t in (fa, f_b, beta, a_log, dt_bias, state)}) == 1)


def kda_decode_fb_fits(q, k, v, fa, f_b, beta, a_log, dt_bias, state) -> bool:
    """Calls triton_kda takes: q, k [M, H, K] and v [M, H, V] with unit strides inside a row, K and V
    powers of two in [16, 256], fa [M, R] (R a multiple of 8) with unit stride along R, f_b [H * K, R]
    contiguous, all of one float dtype; beta [M, H] with unit stride along H; A_log [H] and dt_bias
    [H * K] contiguous; the state [M, H, K, V] fp32 contiguous."""
    if q.dim() != 3 or v.dim() != 3:
        return False
    M, H, K = q.shape
    V = v.shape[-1]
    return (tuple(k.shape) == (M, H, K) and tuple(v.shape[:2]) == (M, H)
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k, v))
            and k.dtype == v.dtype == q.dtype and q.device == k.device == v.device == state.device
            and _kda_fb_rest_fits(M, H, K, V, q.dtype, fa, f_b, beta, a_log, dt_bias, state))


def kda_decode_fb(q, k, v, fa, f_b, beta, a_log, dt_bias, state, lower: float, scale: float, eps: float,
                  qk_dtype) -> torch.Tensor:
    """k3::kda_decode_fb by triton_kda (the caller checked kda_decode_fb_fits): o [M, H, V] in v's
    dtype; the state updated in place."""
    from . import triton_kda as KK
    M, H, K = q.shape
    V, R = v.shape[-1], fa.shape[-1]
    o = torch.empty(M, H, V, dtype=v.dtype, device=v.device)
    bv = min(int(knob("kda_fb_bv") or KDA_FB_BV), V)
    KK.kda_decode_fb_kernel[(M * H * (V // bv),)](
        q, k, v, fa, f_b, beta, a_log, dt_bias, state, o, H, q.stride(0), k.stride(0), v.stride(0), fa.stride(0),
        beta.stride(0), float(lower), float(scale), float(eps), K=K, V=V, R=R, BV=bv, BR=min(32, R & -R),
        QK_DT=_TL[qk_dtype], F_DT=_TL[fa.dtype], num_warps=4)
    return o


# programs per (token, head) of the KDA step kernel (value blocks of KDA_FB_BV split over them; the q / k
# conv shift by the last to arrive: triton_kda's docstring); 1 where no counters are to be had
KDA_STEP_P = 4


def kda_step_decode_fits(xq, xk, xv, w, fa, f_b, beta, a_log, dt_bias, conv_state, state) -> bool:
    """Calls triton_kda's step kernel takes: the conv op's (kda_conv_decode_fits) with width 4 and the
    value head width equal to the key's (one conv over [q | k | v] channels of H heads each), and
    kda_decode_fb_fits on the conv's outputs viewed [M, H, K]."""
    if xq.dim() != 2 or a_log.dim() != 1 or not kda_conv_decode_fits(xq, xk, xv, conv_state, w) or w.shape[1] != 4:
        return False
    M, H = xq.shape[0], a_log.shape[0]
    if H == 0 or xq.shape[1] % H:
        return False
    K = xq.shape[1] // H   # the conv's outputs viewed [M, H, K], V = K
    return (w.dtype == xq.dtype and conv_state.is_contiguous() and xq.device == state.device
            and _kda_fb_rest_fits(M, H, K, K, xq.dtype, fa, f_b, beta, a_log, dt_bias, state))


def kda_onorm_fits(xq, xv, a_log, o_norm, gate) -> bool:
    """The output norm kda_step_decode_kernel takes (NORM): a [V] weight and a gate [M, H * V] with unit
    stride along it, both in the model dtype, V a power of two (one head's row in registers)."""
    M, H = xq.shape[0], a_log.shape[0]
    V = xq.shape[1] // H
    return (gate is not None and o_norm.dim() == 1 and o_norm.shape[0] == V and o_norm.is_contiguous()
            and gate.dim() == 2 and tuple(gate.shape) == (M, H * V) and gate.stride(1) == 1
            and o_norm.dtype == gate.dtype == xv.dtype and V & (V - 1) == 0
            and o_norm.device == gate.device == xq.device)


def kda_step_decode(xq, xk, xv, w, fa, f_b, beta, a_log, dt_bias, conv_state, state, lower: float, scale: float,
                    eps: float, qk_dtype, o_norm=None, gate=None, o_eps: float = 0.0) -> torch.Tensor:
    """k3::kda_step_decode_ by triton_kda (the caller checked kda_step_decode_fits, and kda_onorm_fits
    with o_norm): o [M, H, V] (with o_norm: normed and gated); the conv state and the state updated in
    place."""
    from . import triton_kda as KK
    M, H = xq.shape[0], a_log.shape[0]
    K = V = xq.shape[1] // H
    R = fa.shape[-1]
    o = torch.empty(M, H, V, dtype=xv.dtype, device=xv.device)
    bv = min(int(knob("kda_fb_bv") or KDA_FB_BV), V)
    p = max(1, min(int(knob("kda_step_p") or KDA_STEP_P), V // bv))
    while (V // bv) % p:
        p -= 1
    cnt = split_counters(xq.device) if p > 1 and M * H <= SPLIT_SLOTS else None
    if cnt is None:   # no counters for this call: one program per (token, head)
        p, cnt = 1, o
    norm = o_norm is not None
    KK.kda_step_decode_kernel[(M * H * p,)](
        xq, xk, xv, conv_state, w, fa, f_b, beta, a_log, dt_bias, state, o, cnt, H, xq.stride(0), xk.stride(0),
        xv.stride(0), *conv_state.stride(), fa.stride(0), beta.stride(0), float(lower), float(scale), float(eps),
        o_norm if norm else o, gate if norm else o, gate.stride(0) if norm else 0, float(o_eps),
        K=K, V=V, R=R, BV=bv, P=p, BR=min(32, R & -R), QK_DT=_TL[qk_dtype], F_DT=_TL[fa.dtype], NORM=norm,
        num_warps=4)
    return o


def residual_norm(delta, peers: Peers | None, residual, blocks, w_norm, w_qk, g, eps, start_prefetch=_no_prefetch,
                  rnd: int = 0):
    """The layer-input op: one kernel, the all-reduce of delta (peers None: delta as it is) +
    residual add + AttnRes / RMSNorm (ar_residual_norm_kernel, the o-proj op's kernel without its GEMM)."""
    join = start_prefetch()
    out = ar_residual_norm(delta, peers, residual, g, w_norm, w_qk, list(blocks), eps, None, rnd)
    join()
    return out


def all_reduce(x, peers: Peers, start_prefetch=_no_prefetch):
    join = start_prefetch()
    out, _ = ar_residual_norm(x, peers, None, None, None, None, [], 0.0)
    join()
    return out


def _divisor(n: int, options=(128, 64, 32, 16)) -> int:
    return next((b for b in options if n % b == 0), 0)


MXFP4_VARIANTS = ("v1", "dot", "v2b", "v3", "v3g", "v4g", "cute", "cute_h2")
# From this many tokens the default Triton kernel is v4g (pairs grouped by expert), below it v3.
# v4g replaced v3g there: cold routings, one H200, TP=8 / TP=2 shapes (BENCHMARKS.md),
# v4g (BL=128) vs v3g 1.22-1.20x at M=16, 1.25-1.23x at 64, 1.48-1.39x at
# 256; MUL2 (the scales by bf16x2 multiplies) 1.20-1.23x more at M = 64, 256. (v3g vs v3
# before: 0.94-0.95x at M=64, 1.14-1.88x at M = 96..192, 2.2-2.3x at M=256.)
# Not run above M=256: v3 stays the default there. MXFP4_GROUPED_MAX_P: the grouping is one
# program over all P = M * top-k expert ids and all experts (mxfp4_experts_ok refuses more of either).
MXFP4_GROUPED_MIN_N, MXFP4_GROUPED_MAX_N, MXFP4_GROUPED_MAX_P = 65, 256, 8192
# "cute" / "cute_h2": the AOT-built CuTe DSL GEMVs (kernels/cute/mxfp4_experts.py, fp32 / f16x2
# math, through the driver-only loader); where no artifact fits (or not CUDA / not bf16 /
# misaligned) they run the Triton default (CUTE_FALLBACK, or v4g at MXFP4_GROUPED_MIN_N..MAX_N
# tokens) and choose.fallbacks() says why
CUTE_FALLBACK = "v3"


# Tiles by batch (tokens N <= bound), from the tile sweeps on the H200 (BENCHMARKS.md, TP=8 shapes).
# v2b: at M=1 num_warps=8 was best, 35.6 us vs 43.9 us; at M=16 the pipelined loop with 32 rows,
# 378 us vs 519 us. v3: its defaults at M=1 (22.8 us; the best of 9 tiles, BL=64, was 22.1 us,
# within noise); at M=16 k steps of 128 bytes in gate-up, 231.3 us vs 246.5 us.
# Shapes these tiles do not fit use the variant's defaults.
MXFP4_TUNED = {"v2b": ((4, {"num_warps": 8}), (1 << 30, {"LOOP": 1, "num_stages": 3, "BI": 32})),
               "v3": ((4, {}), (1 << 30, {"BKB_GU": 128}))}


def mxfp4_variant(variant: str | None = None, x: torch.Tensor | None = None, I: int | None = None,
                  N: int | None = None) -> str:
    """The expert-kernel variant: the argument, else env K3_KNOBS mxfp4, else the default: for bf16
    activations where v3's tiles fit the shapes, "cute_h2" (the CuTe f16x2 GEMVs) on CUDA at the
    batch sizes choose.CUTE_M measured it faster (it falls back to v3 / v4g, with the reason, where
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
    report's kernel note, choose.experts_note, asks the same)."""
    if not bf16 or _mxfp4_tiles("v3", L, I, None) is None:
        return "v2b"
    if cuda and N is not None and choose.wanted("mxfp4_experts", N):
        return "cute_h2"
    return _triton_mxfp4(N)


def _triton_mxfp4(N: int | None) -> str:
    """The Triton expert kernel for bf16 activations at N tokens (unknown N: v3)."""
    return "v4g" if N is not None and MXFP4_GROUPED_MIN_N <= N <= MXFP4_GROUPED_MAX_N else CUTE_FALLBACK


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
    from . import triton_moe as KM
    N, L = x.shape
    out = torch.empty(N, L, dtype=torch.bfloat16 if x.is_cuda else torch.float32, device=x.device)
    KM.v4g_operand_kernel[(N, triton.cdiv(L, 1024))](x, out, L, BLOCK=1024)
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
    from . import triton_moe as KM
    N, K = topk_ids.shape
    L, I = x.shape[1], w13.shape[1] // 2
    variant = mxfp4_variant(variant, x, I, N)
    if variant.startswith("cute"):
        out = choose.mxfp4_experts_cute(x, topk_ids, w13, w13_scale, w2, w2_scale, beta, linear_beta,
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
        tuned = next((t for bound, t in MXFP4_TUNED.get(variant, ()) if N <= bound), None)
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
        KM.mxfp4_gate_up_v3_kernel[(P, I // d["BI"])](x, ids, w13, w13_scale, mid, K, I, L, float(beta),
                                                     float(linear_beta), BI=d["BI"], BKB=d["BKB_GU"], **v3)
        KM.mxfp4_down_v3_kernel[(P, L // d["BL"])](mid, ids, w2, w2_scale, out, I, L, BL=d["BL"], BKB=d["BKB_D"],
                                                  **v3)
        return out
    if variant in ("v3g", "v4g"):
        if max(P, w13.shape[0]) > MXFP4_GROUPED_MAX_P:
            raise ValueError(f"MXFP4 experts {variant} groups at most {MXFP4_GROUPED_MAX_P} (token, expert) pairs "
                             f"of as many experts in one program; got {P} pairs, {w13.shape[0]} experts: use v3")
        # group the pairs by expert (one program), then the GEMVs' programs loop over the tiles
        order, sorted_e, tstart = (torch.empty(P, dtype=torch.int32, device=x.device) for _ in range(3))
        EB = triton.next_power_of_2(w13.shape[0])
        ws = torch.empty(3 * EB, dtype=torch.int32, device=x.device)
        KM.mxfp4_group_count_kernel[(1,)](ids, order, sorted_e, tstart, ws, P, PB=triton.next_power_of_2(P),
                                          EB=EB, TG=d["TG"], num_warps=4 if P <= 1024 else 8)
        g = dict(TG=d["TG"], FP16=d["FP16"], DOT_F32=int(not x.is_cuda),
                 V4=0 if variant == "v3g" else 2 if d["MUL2"] else 1, **opts)
        xg = x
        if variant == "v4g":   # B operands in the A tile's K order, times 2^63 (triton_moe: v4g)
            xg = _v4g_operand(x)
        # persistent over the tiles (at most P of them): about PROGS programs in all
        rb_gu, rb_d = I // d["BI"], L // d["BL"]
        KM.mxfp4_gate_up_v3g_kernel[(min(P, -(-d["PROGS"] // rb_gu)), rb_gu)](
            xg, order, sorted_e, tstart, w13, w13_scale, mid, P, K, I, L, float(beta), float(linear_beta),
            BI=d["BI"], BKB=d["BKB_GU"], **g)
        KM.mxfp4_down_v3g_kernel[(min(P, -(-d["PROGS"] // rb_d)), rb_d)](
            mid, order, sorted_e, tstart, w2, w2_scale, out, P, I, L, BL=d["BL"], BKB=d["BKB_D"], **g)
        return out
    if variant != "v1":
        opts["LOOP"] = d["LOOP"]
    if variant == "dot":
        KM.mxfp4_gate_up_dot_kernel[(P, I // d["BN"])](x, ids, w13, w13_scale, mid, K, I, L, float(beta),
                                                      float(linear_beta), BN=d["BN"], BKB=d["BKB_GU"], BT=d["BT"],
                                                      **opts)
        KM.mxfp4_down_dot_kernel[(P, L // d["BN_D"])](mid, ids, w2, w2_scale, out, I, L, BN=d["BN_D"],
                                                     BKB=d["BKB_D"], BT=d["BT"], **opts)
        return out
    gu, dn = ((KM.mxfp4_gate_up_v2b_kernel, KM.mxfp4_down_v2b_kernel) if variant == "v2b"
              else (KM.mxfp4_gate_up_kernel, KM.mxfp4_down_kernel))
    gu[(P, I // d["BI"])](x, ids, w13, w13_scale, mid, K, I, L, float(beta), float(linear_beta),
                          BI=d["BI"], BKB=d["BKB_GU"], **opts)
    dn[(P, L // d["BL"])](mid, ids, w2, w2_scale, out, I, L, BL=d["BL"], BKB=d["BKB_D"], **opts)
    return out


def kda_decode_gated_fla(q, k, v, f, beta, a_log, dt_bias, state, lower: float, scale: float) -> torch.Tensor:
    """k3::kda_decode_gated as one fla-core ``fused_recurrent_kda`` kernel (T = 1): q and k
    L2-normalised in the kernel (x / sqrt(sum(x^2) + 1e-6)), q scaled, the decay lower *
    sigmoid(exp(A_log) * (f + dt_bias)) and beta's sigmoid in the kernel; the K-major fp32 state
    updated in place, the output written into an empty buffer (attention_ops.fla_decode_in_place).
    The caller checked `attention_ops.fla_fused_recurrent_kda_fwd()` and a contiguous fp32 state."""
    from ..model.attention_ops import fla_decode_in_place, fla_qkv
    args = tuple(x.unsqueeze(1) for x in (*fla_qkv(q, k, v), f.contiguous(), beta.contiguous()))  # T = 1
    return fla_decode_in_place(args, dict(A_log=a_log.float().contiguous(), dt_bias=dt_bias.float().contiguous().view(-1),
                                           scale=float(scale), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                           use_beta_sigmoid_in_kernel=True, lower_bound=float(lower)),
                                state, v.dtype)
