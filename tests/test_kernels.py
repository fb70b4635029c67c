"""The Triton communication kernels on CPU (TRITON_INTERPRET=1), with the other ranks simulated.

Each test plays rank r of a TP group: the peers' symmetric buffers are ordinary tensors filled
with what those ranks' GEMMs would have written, and the peers' barrier signals are set in this
rank's signal pad beforehand. The whole op (`kernels.comm.oproj` etc.) must equal the op's
PyTorch reference over the same partials; afterwards this rank's pad must be back to zero and
each peer's pad must hold exactly this rank's signals. fp32 is checked to 1e-5, fp16 to 1e-2
(the references round the all-reduce result and the residual the same way). Not bf16: the
interpreter truncates fp32 -> bf16 where the GPU rounds to nearest, so bf16 runs in the GPU suite.
"""
from __future__ import annotations

import os

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")
# conftest turns the interpreter on when there is no GPU; setting it here would leak into the GPU
# suite collected in the same process (it did: every Triton test of `pytest -m gpu` ran interpreted).
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("these tests simulate peers on CPU; the GPU suite tests the kernels on CUDA",
                allow_module_level=True)

from k3compile.config import knobs_text  # noqa: E402
from k3compile.kernels import attention, comm, gemm, moe, tuning  # noqa: E402
from k3compile.kernels.cute import artifacts  # noqa: E402
from k3compile.model.functional import attnres_mix, rms_norm  # noqa: E402
from simpeers import SimGroup  # noqa: E402
from _mxfp4_data import random_experts  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}


def _weights(N, dtype, g):
    return [(torch.rand(N, generator=g) + 0.5).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("world,rank,nb,M,programs,vec", [
    (1, 0, 0, 3, 0, 1), (1, 0, 2, 2, 0, 1), (2, 1, 0, 3, 0, 1), (2, 0, 3, 2, 0, 1), (4, 2, 1, 1, 0, 1), (2, 1, 3, 5, 2, 1),
    (1, 0, 2, 3, 2, 1), (4, 2, 1, 3, 0, 0), (8, 7, 0, 2, 0, 1), (1, 0, 6, 2, 0, 1), (2, 1, 5, 2, 0, 0),
    (1, 0, 3, 1, 0, 1), (1, 0, 4, 2, 0, 1), (1, 0, 8, 1, 0, 1), (2, 0, 8, 1, 0, 1), (1, 0, 3, 2, 0, 0),
    (8, 3, 3, 1, 0, 1)])
def test_oproj_allreduce_residual_norm(dtype, world, rank, nb, M, programs, vec, monkeypatch):
    """programs > 0: fewer programs than rows, so a program's later rows take the loop after its
    first (whose residual and blocks are read between the barrier's signal and wait); vec=0: the
    45ff89b order (comm.COMM_VEC=0: the peers signalled and polled one by one; COMM_EARLY=0) and
    each block row loaded just before it is reduced (AR_PRELOAD=0), g, the AttnRes query and the
    residual held in fp32 for the whole kernel (AR_LEAN=0), the AttnRes sources one by one (AR_JOINT=0);
    nb > 4: blocks past the four preloaded ones (a second group of four with AR_JOINT; at world 1 the
    updated row joins a group, or comes after full groups at nb = 4 and 8). At world 1 with AR_JOINT the
    block rows are loaded before the updated row's store at even nb (AR_W1_FIRST, the default), after it
    at odd nb."""
    monkeypatch.setattr(tuning, "COLS", False)   # the row kernels (the column-split form: below)
    monkeypatch.setattr(comm, "AR_W1_FIRST", nb % 2 == 0)
    monkeypatch.setattr(comm, "AR_LEAN", bool(vec))
    monkeypatch.setattr(comm, "AR_JOINT", bool(vec))
    monkeypatch.setattr(comm, "COMM_VEC", bool(vec))
    monkeypatch.setattr(comm, "COMM_EARLY", bool(vec))
    monkeypatch.setattr(comm, "AR_PRELOAD", bool(vec))
    g = torch.Generator().manual_seed(world * 10 + nb)
    K, N = 24, 48
    xs = [torch.randn(M, K, generator=g).to(dtype) for _ in range(world)]
    w = (torch.randn(N, K, generator=g) / 4).to(dtype)
    res = torch.randn(M, N, generator=g).to(dtype)
    blocks = [torch.randn(M, N, generator=g).to(dtype) for _ in range(nb)]
    w_norm, w_qk, gam = _weights(N, dtype, g)
    sim = SimGroup(world, rank, M * N * 4) if world > 1 else None
    progs = programs or M
    if programs:
        monkeypatch.setattr(comm, "MAX_PROGRAMS", programs)   # TP=1 (no peers)
    if sim:
        sim.peers.programs = progs
        for p in range(world):  # the peers' GEMMs
            if p != rank:
                torch.mm(xs[p], w.t(), out=sim.view(p, dtype, M, N))
        sim.arm(progs)
    upd, nrm = comm.oproj(xs[rank], w, sim.peers if sim else None, res, blocks, w_norm, w_qk, gam, 1e-5)
    if sim:
        sim.check_signals(progs, 0)  # and this rank's partial was copied in for the peers:
        torch.testing.assert_close(sim.view(rank, dtype, M, N, half=0), F.linear(xs[rank], w))
    y = sum(F.linear(x, w).float() for x in xs).to(dtype)  # the all-reduced partials, rounded once
    ref_nrm, ref_upd = attnres_mix(res, y, blocks, w_norm, w_qk, gam, 1e-5)
    torch.testing.assert_close(upd, ref_upd, **TOL[dtype])
    torch.testing.assert_close(nrm, ref_nrm, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("world,rank,nb,M,N,res", [
    (1, 0, 3, 1, 200, 1), (1, 0, 0, 2, 200, 1), (1, 0, 7, 3, 130, 1), (1, 0, 2, 4, 96, 0), (2, 1, 3, 1, 200, 1),
    (4, 2, 1, 3, 160, 1), (8, 5, 3, 1, 256, 1), (2, 0, 0, 1, 64, 1)])
def test_all_reduce_norm_columns_split_over_programs(dtype, world, rank, nb, M, N, res, monkeypatch):
    """The column-split form (triton_cols.ar_norm_cols_kernel; 32 columns per program here, so 2-7
    programs, the last one partly masked): the same updated row and AttnRes / RMSNorm output as the
    reference, each rank's partial copied into its buffer for the peers, one barrier slot per
    program. On CPU the kernel runs in two launches split at its grid barrier."""
    monkeypatch.setattr(tuning, "COLS_W", 32)
    monkeypatch.setattr(tuning, "COLS_MIN_WORLD", 1)   # the form at every group size and up to 4 rows
    monkeypatch.setattr(tuning, "COLS_MAX_M", 4)
    monkeypatch.setattr(tuning, "COLS_MAX_TILE", 4096)
    g = torch.Generator().manual_seed(world * 10 + nb + N)
    parts = [torch.randn(M, N, generator=g).to(dtype) for _ in range(world)]
    resid = torch.randn(M, N, generator=g).to(dtype) if res else None
    blocks = [torch.randn(M, N, generator=g).to(dtype) * (1 + i) for i in range(nb)]
    w_norm, w_qk, gam = _weights(N, dtype, g)
    sim = SimGroup(world, rank, M * N * 4) if world > 1 else None
    plan = comm.cols_plan(M, N, nb + 1, sim.peers if sim else None)
    assert plan is not None and plan.programs == -(-N // 32) and plan.programs >= 2
    if sim:
        for p in range(world):
            if p != rank:
                sim.view(p, dtype, M, N).copy_(parts[p])
        sim.arm(plan.programs)
    upd, nrm = comm.ar_residual_norm(parts[rank], sim.peers if sim else None, resid, gam, w_norm, w_qk,
                                       blocks, 1e-5)
    y = sum(x.float() for x in parts).to(dtype)
    ref_nrm, ref_upd = attnres_mix(resid if res else torch.zeros_like(y), y, blocks, w_norm, w_qk, gam, 1e-5)
    torch.testing.assert_close(upd, ref_upd, **TOL[dtype])
    torch.testing.assert_close(nrm, ref_nrm, **TOL[dtype])
    if sim:
        sim.check_signals(plan.programs, 0)
        torch.testing.assert_close(sim.view(rank, dtype, M, N, half=0), parts[rank])


def test_columns_split_plan_keeps_its_limits(monkeypatch):
    """cols_plan: by default at one row and group size >= 2 only; off with COLS (K3_KNOBS=cols=0), above
    COLS_MAX_M rows, past 8 sources, and where the tile a program holds would pass COLS_MAX_TILE or
    the programs COLS_MAX_PROGRAMS or the peers' barrier slots."""
    sim = SimGroup(8, 0, 1024, pad_bytes=2048)
    assert sim.peers.programs == 64
    assert comm.cols_plan(1, 7168, 4, None) is None                      # group size 1: the row kernels
    p = comm.cols_plan(1, 7168, 4, sim.peers)
    assert (p.programs, p.w, p.rows, p.s_pad) == (56, 128, 1, 4)
    p = comm.cols_plan(1, 3584, 1, sim.peers)                           # the latent tail
    assert (p.programs, p.w, p.s_pad) == (28, 128, 2)
    assert comm.cols_plan(1, 7168, 6, sim.peers) is None                 # 64 columns: 112 programs
    assert comm.cols_plan(2, 7168, 4, sim.peers) is None                 # one row only
    assert comm.cols_plan(1, 7168, 4, SimGroup(8, 0, 1024, pad_bytes=512).peers) is None   # 16 slots
    monkeypatch.setenv("K3_KNOBS", knobs_text(cols="1"))
    p = comm.cols_plan(1, 7168, 4, None)
    assert (p.programs, p.w, p.rows, p.s_pad) == (56, 128, 1, 4)
    monkeypatch.setattr(tuning, "COLS_MAX_M", 4)
    monkeypatch.setattr(tuning, "COLS_MAX_TILE", 4096)
    p = comm.cols_plan(4, 7168, 8, None)
    assert p.rows * p.s_pad * p.w <= 4096 and p.programs <= tuning.COLS_MAX_PROGRAMS
    assert comm.cols_plan(5, 7168, 4, None) is None
    assert comm.cols_plan(1, 7168, 9, None) is None
    monkeypatch.setenv("K3_KNOBS", knobs_text(cols="0"))
    assert comm.cols_plan(1, 7168, 4, sim.peers) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("world,rank,M", [(1, 0, 1), (1, 0, 3), (2, 1, 2), (8, 3, 1)])
def test_moe_latent_tail_columns_split_over_programs(dtype, world, rank, M, monkeypatch):
    """triton_cols.latent_tail_cols_kernel through the whole tail op: the finalize, the all-reduce,
    the norm and the shared partial's copy split over the programs' columns."""
    monkeypatch.setattr(tuning, "COLS_W", 32)
    monkeypatch.setattr(tuning, "COLS_MIN_WORLD", 1)
    monkeypatch.setattr(tuning, "COLS_MAX_M", 4)
    monkeypatch.setattr(tuning, "COLS_MAX_TILE", 4096)
    case = _TailCase(dtype, world, rank, M, L=136, H=200, seed=7 * M + world)
    plan = comm.cols_plan(M, 136, 1, case.sim.peers if case.sim else None)
    assert plan.programs == 5
    case.run_and_check(plan.programs)


class FakePush:
    """The CuTe push GEMM's contract (cute/skinny_gemm.SkinnyGemmPushSm90) played in PyTorch on a
    SimGroup: rank r's partial x @ w^T goes into slot r of every rank's buffer half epoch[0]
    (element (r * M + m) * N + n), and rank r's flags in every other rank's flag region
    (int32 at flag_off, index r * 128 + t) get the call's sequence number for each 64-column tile."""

    def __init__(self, sim, xs):
        self.sim, self.xs = sim, xs

    def launch_push(self, x, w, peers, flag_off):
        sim = self.sim
        M, N = x.shape[0], w.shape[0]
        seq = int(sim.epoch[2]) + 1
        assert torch.equal(x, self.xs[sim.rank])  # the op hands this rank's x to the GEMM
        for r in range(sim.world):   # every rank's GEMM (this one included) pushes into every buffer
            part = F.linear(self.xs[r], w)
            for d in range(sim.world):
                sim.view(d, x.dtype, sim.world * M * N)[r * M * N:(r + 1) * M * N].copy_(part.reshape(-1))
                if d != r:
                    sim.bufs[d][flag_off:].view(torch.int32)[r * 128:r * 128 + (N + 63) // 64] = seq


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("world,rank,nb,M,N", [(2, 1, 0, 3, 160), (2, 0, 3, 2, 48), (4, 2, 1, 1, 130)])
def test_oproj_with_pushed_partials(dtype, world, rank, nb, M, N):
    """PUSHED: the all-reduce + residual + norm kernel after the push GEMM reads every rank's
    partial from this rank's own buffer once the flags say it is there: no copy, no barrier
    signals (the pads stay zero), the same result as the pull path, and the half flips."""
    g = torch.Generator().manual_seed(world * 100 + N)
    K = 24
    xs = [torch.randn(M, K, generator=g).to(dtype) for _ in range(world)]
    w = (torch.randn(N, K, generator=g) / 4).to(dtype)
    res = torch.randn(M, N, generator=g).to(dtype)
    blocks = [torch.randn(M, N, generator=g).to(dtype) for _ in range(nb)]
    w_norm, w_qk, gam = _weights(N, dtype, g)
    sim = SimGroup(world, rank, world * M * N * 4, flag_bytes=4 * 128 * world)
    sim.epoch[2] = 41   # a later call: the flags must carry its number, 42
    upd, nrm = comm.oproj(xs[rank], w, sim.peers, res, blocks, w_norm, w_qk, gam, 1e-5, push=FakePush(sim, xs))
    y = sum(F.linear(x, w).float() for x in xs).to(dtype)
    ref_nrm, ref_upd = attnres_mix(res, y, blocks, w_norm, w_qk, gam, 1e-5)
    torch.testing.assert_close(upd, ref_upd, **TOL[dtype])
    torch.testing.assert_close(nrm, ref_nrm, **TOL[dtype])
    assert all(int(p.abs().sum()) == 0 for p in sim.pads), "the pushed path sent barrier signals"
    assert sim.epoch.tolist() == [1, 0, 42], "the buffer half did not flip / the call was not counted"


class _Cuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA, so dispatch considers the CuTe push GEMM."""
    @property
    def is_cuda(self):
        return True


def test_push_gemm_choice_is_agreed_by_every_rank_and_memoised(monkeypatch):
    """comm.push_gemm: off by default (no measured range), on with K3_KNOBS=cute_push=1; never at TP=1,
    without a flag region or for a call whose partials do not fit a half; the artifact is used only
    when every rank found it (one all-reduce per shape, memoised), otherwise the reason is noted."""
    sim = SimGroup(2, 0, 1 << 16, flag_bytes=1024)
    x, w = torch.zeros(3, 64, dtype=torch.bfloat16).as_subclass(_Cuda), torch.zeros(128, 64, dtype=torch.bfloat16)
    art = object()
    finds, votes, loads = [], [], []
    monkeypatch.setattr(artifacts, "find", lambda *k: finds.append(k) or (art, ""))
    monkeypatch.setattr(comm, "_load", lambda a, dev: loads.append(a))
    monkeypatch.setattr(comm, "_all_ranks", lambda ok, group, dev: votes.append(ok) or ok)
    monkeypatch.setattr(comm, "_PUSH", {})
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute="", cute_push=""))
    assert "oproj_push" not in tuning.CUTE_M and comm.push_gemm(x, w, sim.peers, "tp") is None and not finds
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute_push="1"))
    assert comm.push_gemm(x, w, sim.peers, "tp") is art and comm.push_gemm(x, w, sim.peers, "tp") is art
    assert finds == [("gemm", "oproj_push", 128, 64, 3)] and votes == [True] and loads == [art]  # decided once
    assert comm.push_gemm(x.as_subclass(torch.Tensor), w, sim.peers, "tp") is None     # not CUDA
    tp1 = SimGroup(1, 0, 1 << 16, flag_bytes=1024).peers
    noflags = SimGroup(2, 0, 1 << 16).peers
    assert comm.push_gemm(x, w, tp1, "tp") is None and comm.push_gemm(x, w, noflags, "tp") is None
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute_push="0"))
    assert comm.push_gemm(x, w, sim.peers, "tp2") is None and votes == [True]
    # another rank could not load it: nobody pushes, and the report says why
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute_push="1"))
    monkeypatch.setattr(comm, "_all_ranks", lambda ok, group, dev: votes.append(ok) and False)
    artifacts._WHY.clear()
    with pytest.warns(UserWarning, match="another rank"):
        assert comm.push_gemm(x, w, sim.peers, "tp3") is None
    # partials that do not fit one half of the workspace: not tried, on any rank (all vote no)
    big = torch.zeros(300, 64, dtype=torch.bfloat16).as_subclass(_Cuda)
    with pytest.warns(UserWarning, match="do not fit"):
        assert comm.push_gemm(big, w, sim.peers, "tp") is None
    assert votes[-1] is False and len(finds) == 2
    artifacts._WHY.clear()   # one warning per op and shape
    with pytest.warns(UserWarning, match="dtype"):
        assert comm.push_gemm(x.float(), w.float(), sim.peers, "tp") is None
    assert "dtype torch.float32" in artifacts.fallbacks()["oproj_push N=128 K=64 M=3"]


def test_workspace_halves_leave_the_flag_region_out():
    """The default 16 MiB workspace: two data halves of 8 MiB - 32 KiB (an M=256 fp32 row block of
    7168 still fits one half), the 64 KiB of push flags after them, every offset 16-byte aligned."""
    from k3compile.runtime import symm
    ws = symm.Workspace("g", 0, 2, torch.empty(16 << 20, dtype=torch.uint8), None, None, None, 64, None)
    assert ws.data_bytes == (16 << 20) - symm.FLAG_BYTES and ws.data_bytes % 32 == 0
    assert ws.fits(256 * 7168 * 4) and not ws.fits(ws.data_bytes // 2 + 1)
    assert ws.data_bytes + symm.FLAG_BYTES <= ws.buf.numel() and symm.FLAG_BYTES >= 8 * 128 * 4


def test_all_reduce_norm_kernel_form_by_group_size_and_rows(monkeypatch):
    """comm._ar_form: the lean kernel from group size 4, the joint AttnRes reductions with 32 warps at
    group size >= 8 for one row of 7168 (BLOCK 8192), else the warps by width and joint at group size 1;
    K3_KNOBS ar_lean / K3_KNOBS ar_warps / K3_KNOBS ar_joint (module values) override."""
    monkeypatch.setattr(comm, "AR_LEAN", None)
    monkeypatch.setattr(comm, "AR_WARPS", 0)
    monkeypatch.setattr(comm, "AR_JOINT", None)
    assert comm._ar_form(1, 1, 8192) == (False, 8, True) and comm._ar_form(2, 1, 8192) == (False, 8, False)
    assert comm._ar_form(4, 1, 8192) == (True, 8, False) and comm._ar_form(8, 16, 8192) == (True, 8, False)
    assert comm._ar_form(8, 1, 8192) == (True, 32, True) and comm._ar_form(8, 1, 4096) == (True, 8, False)
    monkeypatch.setattr(comm, "AR_LEAN", False)
    monkeypatch.setattr(comm, "AR_WARPS", 32)
    monkeypatch.setattr(comm, "AR_JOINT", True)
    assert comm._ar_form(8, 1, 8192) == (False, 32, True)


def test_oproj_without_norm_and_plain_all_reduce():
    g = torch.Generator().manual_seed(1)
    M, N = 2, 40
    sim = SimGroup(2, 0, M * N * 4)
    other = torch.randn(M, N, generator=g)
    sim.view(1, torch.float32, M, N).copy_(other)
    x = torch.randn(M, N, generator=g)
    sim.arm(M)
    out = comm.all_reduce(x, sim.peers)
    torch.testing.assert_close(out, x + other)
    sim.check_signals(M, 0)
    torch.testing.assert_close(sim.view(0, torch.float32, M, N, half=0), x)  # copied in for the peers
    # o-proj without a following norm: normed is empty, updated = residual + all-reduce
    w = torch.randn(N, 8, generator=g)
    xs = [torch.randn(M, 8, generator=g) for _ in range(2)]
    torch.mm(xs[1], w.t(), out=sim.view(1, torch.float32, M, N))
    sim.arm(M)
    res = torch.randn(M, N, generator=g)
    upd, nrm = comm.oproj(xs[0], w, sim.peers, res, [], None, None, None, 1e-5)
    assert nrm.numel() == 0
    torch.testing.assert_close(upd, res + xs[0] @ w.t() + xs[1] @ w.t(), atol=1e-5, rtol=1e-5)
    sim.check_signals(M, 1)  # the second call used the other half


@pytest.mark.skipif(not comm.SEQ_BARRIER, reason="the sequence-flag barrier is off (K3_KNOBS=barrier_seq=0)")
@pytest.mark.parametrize("ahead", [0, 1])
def test_seq_barrier_wraps_and_lets_a_peer_one_call_ahead_pass(ahead):
    """The call counter wraps past 2^31 (int32 difference) and a peer that already signalled its
    next call (value seq + 1) still releases this rank."""
    g = torch.Generator().manual_seed(3)
    M, N = 1, 16
    sim = SimGroup(2, 1, M * N * 4)
    sim.epoch[2] = 2 ** 31 - 1  # this call is number -2^31 after the wrap
    other = torch.randn(M, N, generator=g)
    sim.view(0, torch.float32, M, N).copy_(other)
    x = torch.randn(M, N, generator=g)
    sim.pads[1][0 * 2 + 0] = -2 ** 31 + ahead
    out = comm.all_reduce(x, sim.peers)
    torch.testing.assert_close(out, x + other)
    assert int(sim.epoch[2]) == -2 ** 31 and int(sim.pads[0][1]) == -2 ** 31


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("world,rank,M,programs,vec", [(1, 0, 3, 0, 1), (1, 0, 5, 2, 1), (2, 1, 2, 0, 1), (4, 3, 5, 0, 1), (2, 0, 5, 2, 1),
                                                       (4, 3, 5, 0, 0), (8, 5, 3, 2, 1)])
def test_moe_latent_tail(dtype, world, rank, M, programs, vec, monkeypatch):
    """programs > 0: fewer programs than rows; vec=0: the 45ff89b order (comm.COMM_VEC=0, the
    peers signalled and polled one by one; COMM_EARLY=0, the shared partial copied before the signal)."""
    monkeypatch.setattr(tuning, "COLS", False)
    monkeypatch.setattr(comm, "COMM_VEC", bool(vec))
    monkeypatch.setattr(comm, "COMM_EARLY", bool(vec))
    case = _TailCase(dtype, world, rank, M, L=64, H=96, seed=M + world)
    progs = programs or M
    if programs and not case.sim:
        monkeypatch.setattr(comm, "MAX_PROGRAMS", programs)   # TP=1: a program's rows in a loop
    if case.sim:
        case.sim.peers.programs = progs
    case.run_and_check(progs)


class _TailCase:
    """The latent-tail op (comm.moe_tail) as rank `rank` of a simulated group: every rank's
    [M, 3, L] expert outputs and top-k weights, the shared partial [M, H], the up-projection shard;
    run_and_check(programs) arms the peers' signals for that many programs, runs the op, and checks
    it, and what this rank left for its peers, against the PyTorch reference."""

    def __init__(self, dtype, world, rank, M, L, H, seed):
        g = torch.Generator().manual_seed(seed)
        self.dtype, self.world, self.rank, self.M, self.L = dtype, world, rank, M, L
        self.n = H // world
        self.ys = [torch.randn(M, 3, L, generator=g).to(dtype) for _ in range(world)]
        self.ws = torch.softmax(torch.randn(M, 3, generator=g), -1)
        self.sp = torch.randn(M, H, generator=g).to(dtype)
        self.gam = (torch.rand(L, generator=g) + 0.5).to(dtype)
        self.w_up = (torch.randn(self.n, L, generator=g) / 8).to(dtype)
        self.sim = SimGroup(world, rank, M * L * 4) if world > 1 else None

    def _mine(self, p):
        return (self.ys[p].float() * self.ws.unsqueeze(-1)).sum(1).to(self.dtype)

    def run_and_check(self, programs):
        dt, rank, n, sim = self.dtype, self.rank, self.n, self.sim
        if sim:
            for p in range(self.world):  # the peers' finalized partials, written by their own kernels
                if p != rank:
                    sim.view(p, dt, self.M, self.L).copy_(self._mine(p))
            sim.arm(programs)
        out = comm.moe_tail(self.ys[rank], self.ws, sim.peers if sim else None, self.sp, self.gam, self.w_up,
                              1e-5, rank)
        routed = sum(self._mine(p).float() for p in range(self.world)).to(dt)
        ref = self.sp.clone()
        ref[:, rank * n:(rank + 1) * n] = (self.sp[:, rank * n:(rank + 1) * n].float()
                                           + F.linear(rms_norm(routed, self.gam, 1e-5), self.w_up).float()).to(dt)
        torch.testing.assert_close(out, ref, **TOL[dt])
        if sim:
            sim.check_signals(programs, 0)
            torch.testing.assert_close(sim.view(rank, dt, self.M, self.L, half=0), self._mine(rank), **TOL[dt])


@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (4, 1), (4, 3)])
def test_router_latent_gather(world, rank):
    g = torch.Generator().manual_seed(world + rank)
    M, H, E, L = 3, 32, 20, 44  # 64 columns: at TP=4 rank 1's block straddles router and latent
    x = torch.randn(M, H, generator=g)
    wr, wd = torch.randn(E, H, generator=g), torch.randn(L, H, generator=g)
    S = (E + L) // world
    sim = SimGroup(world, rank, M * S * 4)
    for p in range(world):  # each peer's shard, copied into its own buffer by its own kernel
        if p != rank:
            sim.view(p, torch.float32, M * S).copy_(comm.router_latent_shard(x, wr, wd, world, p))
    programs = min(sim.peers.programs, -(-M * (E + L) // 1024))
    sim.arm(programs)
    router, latent = comm.router_latent(x, wr, wd, sim.peers)
    torch.testing.assert_close(router, x @ wr.t(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(latent, x @ wd.t(), atol=1e-5, rtol=1e-5)
    sim.check_signals(programs, 0)


@pytest.mark.parametrize("M, N, K, cfg, dt", [(1, 40, 96, (8, 32, 4, 2), torch.float32),
                                             (3, 37, 100, (4, 64, 4, 2), torch.float16),
                                             (8, 64, 64, (16, 16, 4, 2), torch.bfloat16),
                                             (5, 20, 128, None, torch.float16),
                                             # the LAZY form (a fifth element 1): one sum after the loop
                                             (1, 40, 96, (8, 32, 4, 2, 1), torch.float32),
                                             (3, 37, 100, (4, 64, 4, 2, 1), torch.float16),
                                             (8, 64, 64, (16, 16, 4, 2, 1), torch.bfloat16),
                                             # the tensor-core kernel: unsplit, split (ragged K, a split
                                             # left empty), swapped, 16 tokens (fp16 / fp32: the
                                             # interpreter's bf16 dot is wrong)
                                             (1, 40, 96, gemm.MmaCfg(16, 32, 1), torch.float32),
                                             (3, 37, 100, gemm.MmaCfg(16, 32, 3), torch.float16),
                                             (2, 48, 64, gemm.MmaCfg(16, 16, 8), torch.float32),
                                             (16, 64, 256, gemm.MmaCfg(32, 64, 2), torch.float16),
                                             (5, 70, 130, gemm.MmaCfg(64, 32, 4, swap=True), torch.float16)])
def test_gemv_kernel_matches_matmul_plain_accumulating_and_into_columns(M, N, K, cfg, dt):
    """The decode GEMVs: out = x @ W^T, out += x @ W^T, and into a column slice of a wider buffer
    (the latent tail's up-projection), ragged N and K, M not a power of two. A split MMA config
    leaves its arrival counters zero."""
    g = torch.Generator().manual_seed(M * 100 + N)
    x, w = torch.randn(M, K, generator=g).to(dt), torch.randn(N, K, generator=g).to(dt)
    ref = x.float() @ w.float().t()
    tol = dict(atol=2e-2 * ref.abs().max().item(), rtol=0) if dt != torch.float32 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gemm.gemv(x, w, cfg=cfg).float(), ref, **tol)
    base = torch.randn(M, N, generator=g).to(dt)
    acc = gemm.gemv(x, w, out=base.clone(), accumulate=True, cfg=cfg)
    torch.testing.assert_close(acc.float(), base.float() + ref, **tol)
    wide = torch.zeros(M, N + 10, dtype=dt)
    gemm.gemv(x, w, out=wide[:, 5:5 + N], cfg=cfg)
    torch.testing.assert_close(wide[:, 5:5 + N].float(), ref, **tol)
    assert wide[:, :5].abs().max() == 0 and wide[:, 5 + N:].abs().max() == 0
    if isinstance(cfg, gemm.MmaCfg) and cfg.split > 1:
        assert gemm.split_counters(x.device).abs().max() == 0


@pytest.mark.parametrize("M, N1, N2, K, cfg, dt", [(1, 32, 40, 96, gemm.MmaCfg(16, 32, 1), torch.float32),
                                                   (3, 64, 37, 130, gemm.MmaCfg(32, 32, 3), torch.float16),
                                                   (16, 64, 70, 256, gemm.MmaCfg(64, 64, 2, swap=True), torch.float16),
                                                   # w1's rows not a multiple of BN: two launches
                                                   (2, 40, 24, 64, gemm.MmaCfg(16, 16, 4), torch.float32),
                                                   # the CUDA-core GEMV's stacked form (TWO), K not a
                                                   # multiple of BLOCK_K, and its two-launch fallback
                                                   (1, 32, 40, 96, (8, 32, 4, 2), torch.float32),
                                                   (3, 64, 37, 130, (16, 64, 4, 2), torch.float16),
                                                   (2, 40, 24, 64, (16, 32, 4, 1), torch.float32),
                                                   (3, 64, 37, 130, (16, 64, 4, 2, 1), torch.float16)])
def test_mma_gemm2_two_weights_in_one_launch(M, N1, N2, K, cfg, dt):
    """gemm.mma_gemm2 (the TP=1 router + latent GEMM): x @ w1^T and x @ w2^T of two separate
    weights (neither copied), into fresh outputs and into two column ranges of one NaN-poisoned
    buffer (every element written, nothing outside); the split counters left zero."""
    g = torch.Generator().manual_seed(M * 1000 + N1 + N2)
    x = torch.randn(M, K, generator=g).to(dt)
    w1, w2 = torch.randn(N1, K, generator=g).to(dt), torch.randn(N2, K, generator=g).to(dt)
    r1, r2 = x.float() @ w1.float().t(), x.float() @ w2.float().t()
    big = max(r1.abs().max().item(), r2.abs().max().item())
    tol = dict(atol=2e-2 * big, rtol=0) if dt != torch.float32 else dict(atol=1e-4, rtol=1e-4)
    o1, o2 = gemm.mma_gemm2(x, w1, w2, cfg)
    torch.testing.assert_close(o1.float(), r1, **tol)
    torch.testing.assert_close(o2.float(), r2, **tol)
    buf = torch.full((M, N1 + N2 + 8), float("nan"), dtype=dt)
    gemm.mma_gemm2(x, w1, w2, cfg, out1=buf[:, 4:4 + N1], out2=buf[:, 4 + N1:4 + N1 + N2])
    torch.testing.assert_close(buf[:, 4:4 + N1 + N2].float(), torch.cat([r1, r2], 1), **tol)
    assert buf[:, :4].isnan().all() and buf[:, 4 + N1 + N2:].isnan().all()
    if isinstance(cfg, gemm.MmaCfg) and cfg.split > 1:
        assert gemm.split_counters(x.device).abs().max() == 0
    with pytest.raises(ValueError, match="share K"):
        gemm.mma_gemm2(x, w1, w2[:, :-1], cfg)


def test_router_latent_one_takes_the_stacked_config_or_the_single_gemms(monkeypatch):
    """The TP=1 router + latent op's launcher: the stacked shape's tuned MMA config -> one mma_gemm2
    launch; no config for it -> each GEMM through gemm.gemm (what lower_decode_gemm would run)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 64, generator=g).half()
    wr, wd = torch.randn(32, 64, generator=g).half(), torch.randn(48, 64, generator=g).half()
    calls = []
    monkeypatch.setattr(gemm, "gemv_plan", lambda x, w, out=None, rows=None: calls.append(rows)
                        or gemm.MmaCfg(16, 32, 2))
    r, lat = comm.router_latent_one(x, wr, wd)
    assert calls == [80]
    tol = dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(r.float(), x.float() @ wr.float().t(), **tol)
    torch.testing.assert_close(lat.float(), x.float() @ wd.float().t(), **tol)
    monkeypatch.setattr(gemm, "gemv_plan", lambda x, w, out=None, rows=None: None)
    monkeypatch.setattr(gemm, "gemm", lambda op, x, w, after_trigger=False: calls.append(op) or x @ w.t())
    r, lat = comm.router_latent_one(x, wr, wd)
    assert calls[1:] == ["router", "latent"]
    torch.testing.assert_close(lat, x @ wd.t())


def test_router_latent_one_stacks_a_gemv_config_up_to_its_m(monkeypatch):
    """A CUDA-core GEMV config for the stacked shape (a per-card row) runs as one mma_gemm2 launch too, up to
    GEMV_MAX_M tokens; above it, each GEMM on its own (the GEMV kernel takes no more rows)."""
    g = torch.Generator().manual_seed(6)
    wr, wd = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g)
    monkeypatch.setattr(gemm, "gemv_plan", lambda x, w, out=None, rows=None: (16, 32, 4, 1))
    seen = []
    real = gemm.mma_gemm2
    monkeypatch.setattr(gemm, "mma_gemm2", lambda x, w1, w2, cfg, **kw: seen.append(cfg) or real(x, w1, w2, cfg, **kw))
    x = torch.randn(2, 64, generator=g)
    r, lat = comm.router_latent_one(x, wr, wd)
    assert seen == [(16, 32, 4, 1)]
    torch.testing.assert_close(r, x @ wr.t(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lat, x @ wd.t(), atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(gemm, "gemm", lambda op, x, w, after_trigger=False: x @ w.t())
    comm.router_latent_one(torch.randn(gemm.GEMV_MAX_M + 1, 64, generator=g), wr, wd)
    assert len(seen) == 1


def test_mma_gemm_refuses_more_than_16_tokens_and_splits_only_with_counters(monkeypatch):
    """More tokens than one MMA tile is an error, not a wrong answer; a split call that gets no
    counters (first use inside a CUDA graph capture, too many streams) runs unsplit, still exact."""
    x, w = torch.randn(17, 64), torch.randn(32, 64)
    with pytest.raises(ValueError, match="M <= 16"):
        gemm.mma_gemm(x, w, gemm.MmaCfg(16, 32, 2))
    monkeypatch.setattr(gemm, "split_counters", lambda device: None)
    torch.testing.assert_close(gemm.mma_gemm(x[:4], w, gemm.MmaCfg(16, 16, 4)), x[:4] @ w.t(),
                               atol=1e-4, rtol=1e-4)


def test_gemv_config_names_round_trip():
    """gemv_bench's config names parse back into what dispatch launches."""
    for c in (gemm.MmaCfg(64, 128, 8, 4, 4, True), gemm.MmaCfg(16, 256, 1, 4, 4)):
        assert gemm.parse_cfg(c.name()) == c
    assert gemm.parse_cfg("gemv 8/512/4/3") == (8, 512, 4, 3)
    assert gemm.parse_cfg("gemvl 4/1024/4/3") == (4, 1024, 4, 3, 1)
    for c in ((8, 512, 4, 3), (4, 1024, 4, 3, 1)):
        assert gemm.parse_cfg(gemm.gemv_name(c)) == c
    for bad in ("gemv 8/512/4", "gemvx 8/512/4/3"):
        with pytest.raises(ValueError):
            gemm.parse_cfg(bad)
    with pytest.raises(ValueError):
        gemm.MmaCfg.parse("gemv 8/512/4/3")


def test_gemv_lazy_only_where_its_tile_fits():
    """gemv_parts: the LAZY form where the config asks for it and MP x BLOCK_N x BLOCK_K fp32 fit
    GEMV_LAZY_REGS registers a thread (M=1 at 4 x 1024 on 4 warps: 32), else the plain form (M=8: 256)."""
    assert gemm.gemv_parts((4, 1024, 4, 3, 1), 1) == (4, 1024, 4, 3, True)
    assert gemm.gemv_parts((4, 1024, 4, 3, 1), 8) == (4, 1024, 4, 3, False)
    assert gemm.gemv_parts((4, 1024, 4, 3), 1) == (4, 1024, 4, 3, False)
    assert gemm.gemv_parts((16, 256, 8, 3, 1), 2) == (16, 256, 8, 3, True)


@pytest.mark.parametrize("M, N, K, cfg, dt", [(1, 40, 96, (8, 32, 4, 2), torch.float32),
                                             (3, 37, 100, (4, 64, 4, 2), torch.float16),
                                             (2, 37, 100, (4, 64, 4, 2, 1), torch.float16)])
def test_gemv_pdl_form_matches_matmul(M, N, K, cfg, dt):
    """The PDL GEMV's peeled first weight tile (read before the grid-dependency wait, which the
    interpreter leaves out) gives the same sums, ragged K included; K < BLOCK_K is refused."""
    g = torch.Generator().manual_seed(M * 7 + N)
    x, w = torch.randn(M, K, generator=g).to(dt), torch.randn(N, K, generator=g).to(dt)
    ref = x.float() @ w.float().t()
    tol = dict(atol=2e-2 * ref.abs().max().item(), rtol=0) if dt != torch.float32 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gemm.gemv(x, w, cfg=cfg, pdl=True).float(), ref, **tol)
    base = torch.randn(M, N, generator=g).to(dt)
    torch.testing.assert_close(gemm.gemv(x, w, out=base.clone(), accumulate=True, cfg=cfg, pdl=True).float(),
                               base.float() + ref, **tol)
    with pytest.raises(ValueError, match="K >= BLOCK_K"):
        gemm.gemv(x, w, cfg=(cfg[0], 2 * K, cfg[2], cfg[3]), pdl=True)


def test_gemv_pdl_env_is_cuda_only_and_checks_the_rows(monkeypatch):
    """gemm.gemv_pdl: None off CUDA, before Hopper or with K3_KNOBS=gemv_pdl=off; "on" (or unset with GEMV_PDL_DEFAULT),
    GEMV_PDL_PF's bytes for the weight shape (None for a shape not in it); a number, those bytes for every shape
    (0: PDL without prefetch).
    The L2 prefetch only where each program's rows are one contiguous, 16-byte aligned slice. On CPU the
    variable changes nothing: the interpreter runs the plain GEMV."""
    monkeypatch.setenv("K3_KNOBS", knobs_text(gemv_pdl=""))
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert gemm.gemv_pdl(cpu) is None and gemm.gemv_pdl(cpu, (3648, 7168)) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    shape, pf = next(iter(tuning.GEMV_PDL_PF.items()))
    monkeypatch.setattr(tuning, "GEMV_PDL_DEFAULT", False)
    assert gemm.gemv_pdl(cuda, shape) is None and gemm.gemv_pdl(cuda) is None   # unset: the default, off
    monkeypatch.setattr(tuning, "GEMV_PDL_DEFAULT", True)
    assert gemm.gemv_pdl(cuda, shape) == pf and gemm.gemv_pdl(cuda, (5, 7)) is None
    assert gemm.gemv_pdl(cuda) == 0   # on: the norm kernel triggers
    monkeypatch.setattr(tuning, "GEMV_PDL_DEFAULT", False)
    monkeypatch.setenv("K3_KNOBS", knobs_text(gemv_pdl="on"))
    assert gemm.gemv_pdl(cuda, shape) == pf and gemm.gemv_pdl(cuda, (5, 7)) is None
    monkeypatch.setenv("K3_KNOBS", knobs_text(gemv_pdl_pf="5x7=512;9x16=0"))   # the table replaced (bench rows)
    assert gemm.gemv_pdl(cuda, (5, 7)) == 512 and gemm.gemv_pdl(cuda, (9, 16)) == 0
    assert gemm.gemv_pdl(cuda, shape) is None
    monkeypatch.setenv("K3_KNOBS", knobs_text(gemv_pdl_pf=""))
    monkeypatch.setenv("K3_KNOBS", knobs_text(gemv_pdl="4096"))
    assert gemm.gemv_pdl(cuda, (5, 7)) == 4096 and gemm.gemv_pdl(cpu, (5, 7)) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert gemm.gemv_pdl(cuda, shape) is None   # no griddepcontrol before Hopper
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    for v, want in (("0", 0), ("off", None)):
        monkeypatch.setenv("K3_KNOBS", knobs_text(gemv_pdl=v))
        assert gemm.gemv_pdl(cuda, shape) == want, v
    w = torch.zeros(64, 256, dtype=torch.float16)
    assert gemm._pdl_rows_ok(w, 256)
    assert not gemm._pdl_rows_ok(w[:, :200], 200)            # rows strided: slices not contiguous
    assert not gemm._pdl_rows_ok(w.view(-1)[1:1 + 63 * 256].view(63, 256), 256)   # 2 bytes off 16
    monkeypatch.setenv("K3_KNOBS", knobs_text(gemv_pdl="16384"))
    x = torch.randn(1, 256).half()
    torch.testing.assert_close(gemm.gemv(x, w + 1, cfg=(8, 64, 4, 2)).float(), x.float() @ (w + 1).float().t(),
                               atol=2e-2, rtol=1e-2)


class _Launches:
    """Stands in for a Triton kernel: records each launch's keyword arguments (constexprs, launch options) and
    runs nothing."""

    def __init__(self):
        self.calls: list[dict] = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append(kw)


def test_pdl_pair_is_the_two_calls_arguments(monkeypatch):
    """The PDL pair is what the ops' arguments say (pass pair_pdl sets them in the graph; no state passes between
    two calls): the norm kernel triggers its dependents only with trigger=True, without peers (TP=1), with a norm,
    where PDL is on (gemm.gemv_pdl); a CUDA-core GEMV is the PDL secondary only with after_trigger=True, where
    gemv_pdl gives its shape bytes (then its L2 prefetch) and K >= BLOCK_K; of two weights in two launches only
    the first. The registrations pass both arguments through. In the interpreter the PDL form runs without the
    grid-dependency wait and gives the plain sums."""
    g0 = torch.Generator().manual_seed(3)
    x, w = torch.randn(1, 256, generator=g0), torch.randn(64, 256, generator=g0)
    monkeypatch.setattr(gemm, "gemv_pdl", lambda device, shape=None: 0)
    torch.testing.assert_close(gemm.gemv(x, w, cfg=(8, 64, 4, 2), after_trigger=True), x @ w.t(), atol=1e-4, rtol=1e-4)

    monkeypatch.setenv("K3_KNOBS", knobs_text(cols="0"))   # the row kernel with peers too (not the column split)
    norm_k, gemv_k = _Launches(), _Launches()
    monkeypatch.setattr(comm.triton_comm, "ar_residual_norm_kernel", norm_k)
    monkeypatch.setattr(gemm.triton_gemv, "gemv_kernel", gemv_k)
    pdl = {"bytes": 4096}
    monkeypatch.setattr(gemm, "gemv_pdl", lambda device, shape=None: pdl["bytes"])
    res, gw = torch.randn(1, 256, generator=g0), torch.rand(256, generator=g0) + 0.5
    peers = comm.Peers(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                       torch.zeros(3, dtype=torch.int32), 0, 2, 1 << 20, 8)
    for kw, want in ((dict(trigger=True), True), ({}, False), (dict(trigger=True, peers=peers), False),
                     (dict(trigger=True, g=None), False)):
        a = dict(peers=None, g=gw) | kw
        comm.ar_residual_norm(x, a["peers"], res, a["g"], None, None, [], 1e-6, trigger=a.get("trigger", False))
        assert norm_k.calls[-1]["TRIGGER"] is want, kw
    pdl["bytes"] = None   # K3_KNOBS gemv_pdl=off (or not CUDA sm_90+): no trigger
    comm.ar_residual_norm(x, None, res, gw, None, None, [], 1e-6, trigger=True)
    assert norm_k.calls[-1]["TRIGGER"] is False
    pdl["bytes"] = 4096
    comm._resnorm(x, res, [], None, None, gw, 1e-6, None, [], 0, 0, True)   # the op's registration, TP=1
    assert norm_k.calls[-1]["TRIGGER"] is True
    comm._oproj(x, w, res[:, :64], [], None, None, gw[:64], 1e-6, None, [], 0, 0, True)
    assert norm_k.calls[-1]["TRIGGER"] is True

    def last():
        c = gemv_k.calls[-1]
        return c["PDL"], c["PF"], c["GDC"], "launch_pdl" in c
    gemm.gemv(x, w, cfg=(8, 64, 4, 2), after_trigger=True)
    assert last() == (True, 4096, False, False)   # GDC and launch_pdl on CUDA only
    gemm.gemv(x, w, cfg=(8, 64, 4, 2))
    assert last() == (False, 0, False, False)
    gemm.gemv(x, w, cfg=(8, 512, 4, 2), after_trigger=True)   # K < BLOCK_K: the PDL form reads one whole tile
    assert last()[0] is False
    gemm.gemv(x[:, :200], w[:, :200], cfg=(8, 64, 4, 2), after_trigger=True)   # rows not one slice: no prefetch
    assert last()[:2] == (True, 0)
    pdl["bytes"] = None
    gemm.gemv(x, w, cfg=(8, 64, 4, 2), after_trigger=True)
    assert last()[0] is False
    pdl["bytes"] = 4096
    w2 = torch.randn(32, 256, generator=g0)
    gemm.mma_gemm2(x, w, w2, (8, 64, 4, 2), after_trigger=True)          # one launch over both (TWO)
    assert last()[0] is True and gemv_k.calls[-1]["TWO"]
    gemm.mma_gemm2(x, w[:60], w2, (8, 64, 4, 2), after_trigger=True)     # 60 rows: two launches
    assert [c["PDL"] for c in gemv_k.calls[-2:]] == [True, False]
    monkeypatch.setattr(gemm, "gemv_plan", lambda *a, **k: (8, 64, 4, 2))
    gemm._decode_gemm(x, w, True)
    assert last()[0] is True
    gemm._decode_gemm(x, w)
    assert last()[0] is False
    monkeypatch.setattr(gemm, "two_weight_cfg", lambda *a, **k: (8, 64, 4, 2))
    comm._router1(x, w, w2, 0, 1, None, False, True)
    assert last()[0] is True and gemv_k.calls[-1]["TWO"]


def test_gemv_is_chosen_only_where_measured_faster(monkeypatch, tmp_path):
    """gemm.gemv_plan: CUDA, 1 <= M <= GEMV_MAX_M, bf16/fp16, unit K stride, and a measured
    config for this weight shape at an M >= this M (GEMV_TABLE, or a sweep's JSON through
    K3_KNOBS gemv_table: only rows faster than cuBLAS); K3_KNOBS=gemv=1 / 0 force it on / off."""
    import json
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setenv("K3_KNOBS", knobs_text(gemv="", gemv_table=""))
    monkeypatch.setattr(tuning, "GEMV_TABLE", {(64, 32): {1: (4, 32, 4, 2), 4: (8, 32, 4, 3)}})
    bf = dict(dtype=torch.bfloat16)
    w, x = torch.zeros(64, 32, **bf), torch.zeros(4, 32, **bf)
    assert gemm.gemv_plan(x[:1], w) == (4, 32, 4, 2)
    assert gemm.gemv_plan(x[:2], w) == gemm.gemv_plan(x, w) == (8, 32, 4, 3)
    assert gemm.gemv_plan(torch.zeros(5, 32, **bf), w) is None              # above the measured Ms
    assert gemm.gemv_plan(x, torch.zeros(48, 32, **bf)) is None             # shape not measured
    assert gemm.gemv_plan(x.float(), w.float()) is None                     # fp32
    assert gemm.gemv_plan(torch.zeros(32, 4, **bf).t(), w) is None          # K not unit stride
    rows = [dict(N=48, K=32, M=1, best="gemv 16/64/8/4", speedup_vs_cublas=1.3),
            dict(N=48, K=32, M=4, best="gemv 2/64/4/4", speedup_vs_cublas=0.9)]
    (tmp_path / "g.json").write_text(json.dumps(dict(rows=rows)))
    monkeypatch.setenv("K3_KNOBS", knobs_text(gemv_table=str(tmp_path / "g.json")))
    assert gemm.gemv_plan(x[:1], torch.zeros(48, 32, **bf)) == (16, 64, 8, 4)
    assert gemm.gemv_plan(x, torch.zeros(48, 32, **bf)) is None and gemm.gemv_plan(x, w) is None
    monkeypatch.setenv("K3_KNOBS", knobs_text(gemv="1"))
    assert gemm.gemv_plan(torch.zeros(8, 32, **bf), torch.zeros(40, 32, **bf)) == tuning.GEMV_DEFAULT
    assert gemm.gemv_plan(torch.zeros(9, 32, **bf), w) is None              # above GEMV_MAX_M
    monkeypatch.setenv("K3_KNOBS", knobs_text(gemv="0"))
    assert gemm.gemv_plan(x[:1], torch.zeros(48, 32, **bf)) is None


@pytest.mark.parametrize("E, bn, copies", [(32, 16, False), (24, 16, True)])
def test_router_latent_shard_straddling_rank_without_a_copy(E, bn, copies, monkeypatch):
    """The TP rank whose rows straddle [W_r; W_down] runs one two-weight MMA launch (no copy of its
    rows) where the tuned config's BN divides its router rows; otherwise the kept copy (rank_rows).
    Both equal x @ [W_r; W_down][rows].T; the ranks with rows in one weight are unchanged."""
    g = torch.Generator().manual_seed(E)
    M, H, L, tp = 3, 32, 128 - E, 2
    x = torch.randn(M, H, generator=g)
    wr, wd = torch.randn(E, H, generator=g), torch.randn(L, H, generator=g)
    monkeypatch.setattr(gemm, "gemv_plan", lambda x, w, out=None, rows=None: gemm.MmaCfg(bn, 16, 2))
    copied = []
    real = comm.rank_rows
    monkeypatch.setattr(comm, "rank_rows", lambda *a: copied.append(a[2:]) or real(*a))
    full = x @ torch.cat([wr, wd]).t()
    for rank in range(tp):
        got = comm.router_latent_shard(x, wr, wd, tp, rank).view(M, -1)
        torch.testing.assert_close(got, full[:, rank * 64:(rank + 1) * 64], atol=1e-4, rtol=1e-4)
    assert ((tp, 0) in copied) == copies and (tp, 1) in copied  # rank 1's rows are all W_down's: a view


def test_rank_rows_one_weight_per_rank_views_or_one_kept_copy():
    """The sharded router's rows for one GEMM: ranks inside one weight get views (no copy), the
    straddling rank a copy made once, reused, remade after an in-place weight update, and dropped
    with the weights."""
    import gc
    E, L, K, tp = 20, 44, 8, 4              # S = 16: rank 1 holds router rows 16..19 + latent rows 0..11
    wr, wd = torch.randn(E, K), torch.randn(L, K)
    for rank in (0, 2, 3):
        w = comm.rank_rows(wr, wd, tp, rank)
        assert w.untyped_storage().data_ptr() in (wr.untyped_storage().data_ptr(), wd.untyped_storage().data_ptr())
        assert torch.equal(w, torch.cat([wr, wd])[rank * 16:(rank + 1) * 16])
    w1 = comm.rank_rows(wr, wd, tp, 1)
    assert torch.equal(w1, torch.cat([wr, wd])[16:32]) and comm.rank_rows(wr, wd, tp, 1) is w1
    with torch.no_grad():
        wd[0] += 1.0                          # in place: the version counter moves
    w2 = comm.rank_rows(wr, wd, tp, 1)
    assert w2 is not w1 and torch.equal(w2, torch.cat([wr, wd])[16:32])
    n = len(comm._RANK_ROWS)
    del wr, wd, w1, w2
    gc.collect()
    assert len(comm._RANK_ROWS) == n - 1


@pytest.mark.parametrize("variant", ["v1", "dot", "v2b"])
@pytest.mark.parametrize("N,K,E,I,L", [(1, 2, 4, 64, 64), (3, 4, 8, 32, 128), (2, 2, 3, 96, 96),
                                       (6, 2, 4, 64, 64)])  # N > 4: v2b's tuned pipelined tiles
def test_mxfp4_expert_kernels_match_reference(N, K, E, I, L, variant):
    """The two MXFP4 expert kernels (gate-up + SiTU, down) of each variant vs the model's reference
    op, fp32 activations, random codes and scales (every E2M1 code, scales 2^-4 .. 2^3). "dot" rounds
    its activations (x, and the fp32 SiTU output before the down projection) to bf16, so it is
    compared with the reference on bf16-rounded x at a bf16 tolerance."""
    from k3compile.model.moe_ops import mxfp4_experts_reference
    g = torch.Generator().manual_seed(N * 100 + L)
    x = torch.randn(N, L, generator=g)
    ids = torch.randint(0, E, (N, K), generator=g, dtype=torch.int32)
    w13 = torch.randint(0, 256, (E, 2 * I, L // 2), generator=g, dtype=torch.uint8)
    s13 = torch.randint(123, 131, (E, 2 * I, L // 32), generator=g, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (E, L, I // 2), generator=g, dtype=torch.uint8)
    s2 = torch.randint(118, 124, (E, L, I // 32), generator=g, dtype=torch.uint8)
    assert moe.mxfp4_experts_ok(x, ids, w13, variant=variant)
    if variant == "dot":
        x = x.bfloat16().float()
    out = moe.mxfp4_experts(x, ids, w13, s13, w2, s2, 4.0, 25.0, variant=variant)
    ref = mxfp4_experts_reference(x, ids, w13, s13, w2, s2, 4.0, 25.0)
    tol = 1e-2 if variant == "dot" else 1e-4
    torch.testing.assert_close(out, ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("variant,tiles", [("dot", dict(LOOP=1, BKB_GU=16, BN=16, BN_D=32)),
                                           ("v2b", dict(LOOP=1, BKB_GU=32, BI=32, BL=16)),
                                           ("v1", dict(num_warps=2))])
def test_mxfp4_expert_tiles_match_reference(variant, tiles):
    """Tile overrides (and the runtime tl.range k loop, LOOP=1) give the same results."""
    from k3compile.model.moe_ops import mxfp4_experts_reference
    g = torch.Generator().manual_seed(7)
    N, K, E, I, L = 2, 3, 5, 64, 128
    x = torch.randn(N, L, generator=g).bfloat16().float()
    ids = torch.randint(0, E, (N, K), generator=g, dtype=torch.int32)
    w13 = torch.randint(0, 256, (E, 2 * I, L // 2), generator=g, dtype=torch.uint8)
    s13 = torch.randint(123, 131, (E, 2 * I, L // 32), generator=g, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (E, L, I // 2), generator=g, dtype=torch.uint8)
    s2 = torch.randint(118, 124, (E, L, I // 32), generator=g, dtype=torch.uint8)
    assert moe.mxfp4_experts_ok(x, ids, w13, variant=variant, tiles=tiles)
    out = moe.mxfp4_experts(x, ids, w13, s13, w2, s2, 4.0, 25.0, variant=variant, tiles=tiles)
    ref = mxfp4_experts_reference(x, ids, w13, s13, w2, s2, 4.0, 25.0)
    tol = 1e-2 if variant == "dot" else 1e-4
    torch.testing.assert_close(out, ref, atol=tol * ref.abs().max().item(), rtol=tol)


def _v3_experts(g, E, I, L):
    """Random MXFP4 experts on CPU: every code, gate-up scales 2^-9 .. 2^3, down 2^-9 .. 2^-4."""
    return (torch.randint(0, 256, (E, 2 * I, L // 2), generator=g, dtype=torch.uint8),
            torch.randint(118, 131, (E, 2 * I, L // 32), generator=g, dtype=torch.uint8),
            torch.randint(0, 256, (E, L, I // 2), generator=g, dtype=torch.uint8),
            torch.randint(118, 124, (E, L, I // 32), generator=g, dtype=torch.uint8))


@pytest.mark.parametrize("fp16", [0, 1])
@pytest.mark.parametrize("N,K,E,I,L,tiles", [(1, 2, 4, 128, 128, None), (3, 4, 8, 128, 256, None),
                                             (2, 2, 3, 256, 128, dict(BKB_GU=64, BI=16, BL=32, num_warps=8)),
                                             (6, 2, 4, 128, 512, dict(BKB_GU=128, BI=64, BL=64))])
def test_mxfp4_v3_matches_reference(N, K, E, I, L, tiles, fp16):
    """v3 (bf16 / fp16 bit patterns of code pairs, permuted K order, block-diagonal activation
    tile, scales applied per MMA column) on the CPU interpreter's fp32 dot path (DOT_F32: the same
    bit patterns, permutation and scale logic; only the dot runs in fp32). Every E2M1 code,
    scales 2^-9 .. 2^3 (both kernels), bf16-exact activations. Gate-up alone is checked exactly
    (mid = SiTU(W13 x) in fp32); the whole op also rounds mid to bf16 (fp16) before the down
    projection, so it is compared at a bf16 tolerance."""
    from k3compile.kernels import triton_moe as KM
    from k3compile.model.functional import situ
    from k3compile.model.moe_ops import mxfp4_experts_reference
    from k3compile.model.mxfp4 import _dequantize
    g = torch.Generator().manual_seed(N * 100 + L + fp16)
    x = torch.randn(N, L, generator=g).bfloat16().float()
    ids = torch.randint(0, E, (N, K), generator=g, dtype=torch.int32)
    w13, s13, w2, s2 = _v3_experts(g, E, I, L)
    tiles = dict(tiles or {}, FP16=fp16)
    assert moe.mxfp4_experts_ok(x, ids, w13, variant="v3", tiles=tiles)
    d = moe._mxfp4_tiles("v3", L, I, tiles)
    P = N * K
    mid = torch.empty(P, I)
    KM.mxfp4_gate_up_v3_kernel[(P, I // d["BI"])](x, ids.reshape(-1), w13, s13, mid, K, I, L, 4.0, 25.0,
                                                 BI=d["BI"], BKB=d["BKB_GU"], BT=16, FP16=fp16, DOT_F32=1)
    w13_f = torch.stack([_dequantize(w13[e], s13[e], torch.float32) for e in ids.reshape(-1).tolist()])
    xr = x.repeat_interleave(K, 0)
    want = situ(torch.einsum("pnk,pk->pn", w13_f, xr), 4.0, 25.0)
    # fp32 rounding of an L-term dot in another summation order (numpy's in the interpreter, einsum
    # here) is bounded by the sum of the terms' magnitudes, not by the result's: one element of a
    # cancelling sum was 2.4e-3 off (7.7e-5 relative) with numpy 2.4
    mag = torch.einsum("pnk,pk->pn", w13_f.abs(), xr.abs()).max().item()
    torch.testing.assert_close(mid, want, atol=2e-6 * mag, rtol=1e-5)
    out = moe.mxfp4_experts(x, ids, w13, s13, w2, s2, 4.0, 25.0, variant="v3", tiles=tiles)
    ref = mxfp4_experts_reference(x, ids, w13, s13, w2, s2, 4.0, 25.0)
    tol = 1e-2 if not fp16 else 5e-3
    torch.testing.assert_close(out, ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("N,K,E,I,L,tiles,skew,fp16", [
    (1, 2, 4, 128, 128, None, False, 0),
    (5, 4, 6, 128, 256, dict(PROGS=1, TG=4), False, 1),
    (6, 2, 4, 128, 512, dict(BI=64, BL=64, TG=8), False, 0),
    (9, 3, 3, 256, 256, dict(TG=2, BKB_GU=128, BKB_D=128, BI=16, BL=32, PROGS=3), True, 0),
    (9, 3, 3, 256, 256, dict(PROGS=2), True, 1)])
def test_mxfp4_v3g_matches_reference(N, K, E, I, L, tiles, skew, fp16):
    """v3g (v3's dequantisation and scales, pairs grouped by expert, TG activation vectors per
    tile as MMA columns) on the CPU interpreter's fp32 dot path, against the reference: uniform
    routing and skewed (every token on the same K experts: tiles of several pairs); PROGS=1 / 3:
    a program loops over several tiles."""
    from k3compile.model.moe_ops import mxfp4_experts_reference
    g = torch.Generator().manual_seed(N * 100 + L + fp16)
    x = torch.randn(N, L, generator=g).bfloat16().float()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]).to(torch.int32)
    if skew:
        ids = ids[:1].repeat(N, 1)
    w13, s13, w2, s2 = _v3_experts(g, E, I, L)
    tiles = dict(tiles or {}, FP16=fp16)
    assert moe.mxfp4_experts_ok(x, ids, w13, variant="v3g", tiles=tiles)
    out = moe.mxfp4_experts(x, ids, w13, s13, w2, s2, 4.0, 25.0, variant="v3g", tiles=tiles)
    ref = mxfp4_experts_reference(x, ids, w13, s13, w2, s2, 4.0, 25.0)
    tol = 1e-2 if not fp16 else 5e-3
    torch.testing.assert_close(out, ref, atol=tol * ref.abs().max().item(), rtol=tol)
    assert not moe.mxfp4_experts_ok(x, ids, w13, variant="v3g", tiles=dict(TG=3))   # not a power of 2
    big = torch.zeros(moe.MXFP4_GROUPED_MAX_P // K + 1, K, dtype=torch.int32)     # one grouping program: too many pairs
    assert not moe.mxfp4_experts_ok(x, big, w13, variant="v3g") and moe.mxfp4_experts_ok(x, big, w13, "v3")


@pytest.mark.parametrize("P,E,TG", [(1, 4, 16), (7, 3, 4), (40, 5, 8), (33, 896, 4), (64, 2, 16), (300, 7, 16)])
def test_mxfp4_group_count_kernel_tiles_each_experts_pairs(P, E, TG):
    """mxfp4_group_count_kernel (no sort): order is a permutation of the pairs grouped into the
    experts' runs in expert order (within a run any order), sorted_e their experts, and the tiles
    (tstart >= 0, then -1) cut each run into pieces of TG: every pair in exactly one tile, a tile
    never spans two experts. Scratch filled with garbage first: nothing in it is needed."""
    import triton

    from k3compile.kernels import triton_moe as KM
    g = torch.Generator().manual_seed(P * 7 + E)
    ids = torch.randint(0, E, (P,), generator=g, dtype=torch.int32)
    order, sorted_e, tstart = (torch.full((P,), -7, dtype=torch.int32) for _ in range(3))
    EB = triton.next_power_of_2(E)
    ws = torch.randint(-100, 100, (3 * EB,), generator=g, dtype=torch.int32)
    KM.mxfp4_group_count_kernel[(1,)](ids, order, sorted_e, tstart, ws, P, PB=triton.next_power_of_2(P), EB=EB, TG=TG)
    assert torch.equal(order.sort()[0], torch.arange(P, dtype=torch.int32))
    assert torch.equal(sorted_e, ids[order.long()]) and torch.equal(sorted_e, ids.sort()[0])
    n = int((tstart >= 0).sum())
    assert (tstart[n:] == -1).all() and torch.equal(tstart[:n], tstart[:n].sort()[0])
    want = [i for i in range(P) if (i - next(j for j in range(i + 1) if sorted_e[j] == sorted_e[i])) % TG == 0]
    assert tstart[:n].tolist() == want


@pytest.mark.parametrize("N,K,E,I,L,tiles,skew", [
    (1, 2, 4, 128, 128, None, False),
    (5, 4, 6, 128, 256, dict(PROGS=1), False),
    (6, 2, 4, 128, 512, dict(BI=64, BL=128, BKB_GU=64, MUL2=0), False),
    (9, 3, 3, 256, 256, dict(BKB_GU=64, BKB_D=64, BI=16, BL=32, PROGS=3), True),
    (40, 3, 3, 128, 256, dict(TG=32, PROGS=2), True)])
def test_mxfp4_v4g_matches_reference(N, K, E, I, L, tiles, skew):
    """v4g (v3's dequantisation with the block scales applied to the A tile, pairs grouped by
    expert, one MMA column per pair) on the CPU interpreter's fp32 dot path, against the reference:
    uniform and skewed routing (tiles of several pairs; 40 tokens on 3 experts: runs longer than a
    tile), both grouping kernels, programs looping over tiles. Gate-up scales 2^-9 .. 2^3."""
    from k3compile.model.moe_ops import mxfp4_experts_reference
    g = torch.Generator().manual_seed(N * 100 + L)
    x = torch.randn(N, L, generator=g).bfloat16().float()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]).to(torch.int32)
    if skew:
        ids = ids[:1].repeat(N, 1)
    w13, s13, w2, s2 = _v3_experts(g, E, I, L)
    assert moe.mxfp4_experts_ok(x, ids, w13, variant="v4g", tiles=tiles)
    out = moe.mxfp4_experts(x, ids, w13, s13, w2, s2, 4.0, 25.0, variant="v4g", tiles=tiles)
    ref = mxfp4_experts_reference(x, ids, w13, s13, w2, s2, 4.0, 25.0)
    torch.testing.assert_close(out, ref, atol=1e-2 * ref.abs().max().item(), rtol=1e-2)
    for bad in (dict(TG=8), dict(FP16=1), dict(MUL2=2), dict(BKB_GU=32)):   # N < 16, fp16, unknown, < 64 B
        assert not moe.mxfp4_experts_ok(x, ids, w13, variant="v4g", tiles=bad)
    many = torch.zeros(moe.MXFP4_GROUPED_MAX_P + 1, 1, 1, dtype=torch.uint8).expand(-1, *w13.shape[1:])
    assert not moe.mxfp4_experts_ok(x, ids, many, variant="v4g")        # more experts than one program takes
    # a scale past the A tile's range (2^(s-127), s >= 192) gives inf / NaN in that output, not a wrong number
    s13[ids[0, 0].long(), 0, 0] = 200
    out = moe.mxfp4_experts(x, ids, w13, s13, w2, s2, 4.0, 25.0, variant="v4g", tiles=tiles)
    assert not out[0, 0].isfinite().all()


def test_mxfp4_variant_selection(monkeypatch):
    x = torch.zeros(1, 3584)
    w13 = torch.zeros(1, 2 * 384, 3584 // 2, dtype=torch.uint8)
    ids = torch.zeros(1, 16, dtype=torch.int32)
    monkeypatch.setenv("K3_KNOBS", knobs_text(mxfp4=""))
    xb = x.to(torch.bfloat16)
    # default: v3 for bf16 activations at shapes its tiles fit, else v2b (fp32 activations, or I=32)
    assert moe.mxfp4_variant() == "v3" and moe.mxfp4_variant(None, xb, 384) == "v3"
    assert moe.mxfp4_variant(None, x, 384) == "v2b" and moe.mxfp4_variant(None, xb, 32) == "v2b"
    assert moe.mxfp4_experts_ok(xb, ids, torch.zeros(1, 2 * 32, 1, dtype=torch.uint8))  # through v2b

    class CudaX:  # what mxfp4_variant reads of a CUDA bf16 activation
        is_cuda, dtype, shape = True, torch.bfloat16, (1, 3584)
    # on CUDA the CuTe f16x2 GEMVs in tuning.CUTE_M's measured batch range; above it or when off
    # v3, or v3g (pairs grouped by expert) from MXFP4_GROUPED_MIN_N tokens
    lo, hi = tuning.CUTE_M["mxfp4_experts"]
    g = tuning.MXFP4_GROUPED_MIN_N
    assert moe.mxfp4_variant(None, CudaX(), 384, lo) == "cute_h2" == moe.mxfp4_variant(None, CudaX(), 384, hi)
    assert moe.mxfp4_variant(None, CudaX(), 384, hi + 1) == "v4g" and lo < g <= hi
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute="0"))
    assert moe.mxfp4_variant(None, CudaX(), 384, lo) == "v3" == moe.mxfp4_variant(None, CudaX(), 384, g - 1)
    assert moe.mxfp4_variant(None, CudaX(), 384, g) == "v4g" == moe.mxfp4_variant(None, CudaX(), 384, 256)
    assert moe.mxfp4_variant(None, CudaX(), 384, tuning.MXFP4_GROUPED_MAX_N + 1) == "v3"   # not run above
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute=""))
    monkeypatch.setenv("K3_KNOBS", knobs_text(mxfp4="dot"))
    assert moe.mxfp4_variant() == "dot" and moe.mxfp4_variant("v2b") == "v2b"
    with pytest.raises(ValueError):
        moe.mxfp4_variant("nope")
    for v in moe.MXFP4_VARIANTS:  # the real TP=8 / TP=2 shapes fit every variant
        assert moe.mxfp4_experts_ok(x, ids, w13, variant=v)
        assert moe.mxfp4_experts_ok(x, ids, torch.zeros(1, 2 * 1536, 1, dtype=torch.uint8), variant=v)
    assert not moe.mxfp4_experts_ok(x, ids, torch.zeros(1, 2 * 40, 1, dtype=torch.uint8), variant="dot")
    assert not moe.mxfp4_experts_ok(x, ids, w13, variant="dot", tiles=dict(BN=48))


def test_kernel_path_is_described_for_the_report(monkeypatch):
    from k3compile.kernels.dispatch import describe
    assert describe("cpu", "0") is None  # CPU graphs run the references; nothing to say
    assert describe("cuda", None) == "kernels: CUDA kernels, TP=1 (no communication)"
    # without CUDA the report must say the communication falls back to NCCL, and why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert describe("cuda", "0") == "kernels: NCCL path for every communication op (no CUDA)"
    monkeypatch.setenv("K3_KERNELS", "0")
    assert describe("cuda", "0").startswith("kernels: off (K3_KERNELS=0)")
    # with symmetric memory: which o-proj GEMM runs, and how to change it
    from k3compile.runtime import symm
    monkeypatch.delenv("K3_KERNELS")
    monkeypatch.setattr(symm, "unavailable_reason", lambda group: None)
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute="", cute_push=""))
    assert describe("cuda", "0").endswith("o-proj: cuBLAS GEMM + pull all-reduce kernel (the CuTe push-epilogue "
                                          "GEMM measured no faster; K3_KNOBS=cute_push=1 turns it on)")
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute_push="1"))
    assert "o-proj: CuTe push-epilogue GEMM where every rank has its artifact (K3_KNOBS=cute_push=1" in describe("cuda", "0")
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute_push="0"))
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute="1"))
    assert describe("cuda", "0").endswith("(K3_KNOBS=cute_push=0)")


@pytest.mark.parametrize("M, E, k, dt", [(1, 896, 16, torch.float32), (5, 896, 16, torch.float16),
                                         (3, 100, 7, torch.float32), (2, 64, 64, torch.float32),
                                         (2, 5, 5, torch.float32), (1, 40, 1, torch.float32)])
@pytest.mark.parametrize("sort", ["0", "1"])
def test_router_topk_kernel_matches_reference(M, E, k, dt, sort, monkeypatch):
    """k3::router_topk's kernel, both selection forms (k max-reduction rounds; SORT: Triton's bitonic
    top-k): the same ids in the same order (descending biased score) and the same renormalised
    weights as the PyTorch reference (the model's own router math), int64 ids and int32 ids (k = E,
    k = 1 too)."""
    from k3compile.ops import reference as ref
    monkeypatch.setenv("K3_KNOBS", knobs_text(router_sort=sort))
    g = torch.Generator().manual_seed(M * 1000 + E)
    logits = (torch.randn(M, E, generator=g) * 2).to(dt)
    bias = torch.randn(E, generator=g) * 0.1
    ids, w = moe.router_topk(logits, bias, k, 2.5)
    rid, rw = ref.router_topk(logits, bias, k, 2.5)
    assert torch.equal(ids, rid), (ids, rid)
    torch.testing.assert_close(w, rw, atol=1e-6, rtol=1e-5)
    ids32, w32 = moe.router_topk(logits, bias, k, 2.5, torch.int32)  # what the expert kernels read
    assert ids32.dtype == torch.int32 and torch.equal(ids32, ref.router_topk(logits, bias, k, 2.5, True)[0])
    assert torch.equal(ids32.long(), rid) and torch.equal(w32, w)


def _mla_case(M, H, L, R, S, dt, lens, seed=0):
    """Random queries, new tokens and a cache with NaN past each row's end (garbage that must not leak)."""
    g = torch.Generator().manual_seed(seed)
    ql, qr = torch.randn(M, H, L, generator=g).to(dt), torch.randn(M, H, R, generator=g).to(dt)
    kv_new, cache = torch.randn(M, L + R, generator=g).to(dt), torch.randn(M, S, L + R, generator=g).to(dt)
    for m, n in enumerate(lens):
        cache[m, n + 1:] = float("nan")
    return ql, qr, kv_new, cache, torch.tensor(lens)


@pytest.mark.parametrize("M,H,L,R,S,lens,dt", [
    (1, 12, 32, 16, 100, [57], torch.float32),                 # 4 splits of 32, heads not a multiple of 16
    (3, 20, 64, 16, 70, [0, 68, 33], torch.float32),           # an empty cache, a full one, two head blocks
    (2, 16, 32, 16, 40, [5, 38], torch.float16),
    (2, 4, 16, 16, 600, [599, 1], torch.float32),              # splits longer than a tile; most splits empty
])
@pytest.mark.parametrize("bl", [0, 16])
def test_mla_decode_kernel_matches_reference(M, H, L, R, S, lens, dt, bl, monkeypatch):
    """attention.mla_decode (triton_mla's split + combine kernels) against the op's reference: the same
    output (fp32 to 1e-5, fp16 to 2e-3 relative: the softmax weights are rounded to the cache dtype),
    the same cache after the write, and nothing from the NaN slots past each row's end. Splits as
    short as one tile (MLA_MIN_CH=32), so that these small caches take several. bl: the combine's
    columns per program (0: one program per token and head)."""
    from k3compile.model import attention_ops as A
    monkeypatch.setattr(tuning, "MLA_MIN_CH", 32)
    monkeypatch.setattr(tuning, "MLA_COMBINE_BL", bl)
    ql, qr, kv_new, cache, sl = _mla_case(M, H, L, R, S, dt, lens)
    c1, c2 = cache.clone(), cache.clone()
    ref = A.mla_decode_reference(ql, qr, kv_new, c1, sl, L ** -0.5)
    assert attention.mla_decode_fits(ql, qr, kv_new, c2)
    got = attention.mla_decode(ql, qr, kv_new, c2, sl, L ** -0.5)
    assert got.dtype == ref.dtype and not got.isnan().any()
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err < (1e-5 if dt == torch.float32 else 2e-3), err
    assert torch.equal(c1.nan_to_num(7.0), c2.nan_to_num(7.0))


def test_mla_decode_cuda_path_falls_back_and_keeps_the_op_checks():
    """kernels/model_ops.mla_decode (the op's CUDA kernel unless K3_KNOBS=mla_triton=0), run here on CPU
    tensors: shapes the Triton kernel cannot take (L not a power of two) run the reference; a full
    cache raises the op's error on either path."""
    from k3compile.kernels import model_ops
    from k3compile.model import attention_ops as A
    ql, qr, kv_new, cache, sl = _mla_case(2, 3, 24, 16, 20, torch.float32, [4, 7])
    assert not attention.mla_decode_fits(ql, qr, kv_new, cache)
    c1, c2 = cache.clone(), cache.clone()
    torch.testing.assert_close(model_ops.mla_decode(ql, qr, kv_new, c1, sl, 0.2),
                               A.mla_decode_reference(ql, qr, kv_new, c2, sl, 0.2), rtol=0, atol=0)
    ql, qr, kv_new, cache, sl = _mla_case(1, 4, 16, 16, 8, torch.float32, [7])
    with pytest.raises(ValueError, match="kv_cache is full"):
        model_ops.mla_decode(ql, qr, kv_new, cache, torch.tensor([8]), 0.2)
    got = model_ops.mla_decode(ql, qr, kv_new, cache.clone(), sl, 0.2)   # the last free slot: Triton
    torch.testing.assert_close(got, A.mla_decode_reference(ql, qr, kv_new, cache.clone(), sl, 0.2))


@pytest.mark.parametrize("env, registered", [(None, True), ("0", False), ("1", True)])
def test_importing_k3compile_registers_the_mla_decode_cuda_kernel_unless_disabled(env, registered):
    """`import k3compile` registers kernels/model_ops.mla_decode as k3model::mla_decode's CUDA kernel
    (the default); K3_KNOBS=mla_triton=0 leaves the op's reference on every device. A fresh interpreter each:
    the registration happens once per process."""
    import os
    import subprocess
    import sys
    code = ("import torch, k3compile; from k3compile.model import attention_ops; "
            "print(torch._C._dispatch_has_kernel_for_dispatch_key('k3model::mla_decode', 'CUDA'))")
    e = {k: v for k, v in os.environ.items() if k != "K3_KNOBS"}
    if env is not None:
        e["K3_KNOBS"] = f"mla_triton={env}"
    out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == str(registered), out.stdout + out.stderr


@pytest.mark.parametrize("M, cq, kw, dt", [(1, 40, 4, torch.float32), (3, 24, 4, torch.float16),
                                           (2, 16, 3, torch.bfloat16), (2, 700, 4, torch.float32)])
def test_kda_conv_decode_kernel_matches_reference(M, cq, kw, dt):
    """attention.kda_conv_decode (triton_conv) against the op's reference: q, k, v and the new state,
    with q, k, v read as column slices of one wider projection output (the in_proj GEMM's split);
    700 channels per part: several channel blocks, one straddling two parts. In place too (the new
    state written over the state read): the same results."""
    from k3compile.ops import reference as ref
    g = torch.Generator().manual_seed(M * cq + kw)
    proj = torch.randn(M, 3 * cq + 5, generator=g).to(dt)
    xq, xk, xv = proj[:, :cq], proj[:, cq:2 * cq], proj[:, 2 * cq:3 * cq]
    state = torch.randn(M, 3 * cq, kw - 1, generator=g).to(dt)
    w = (torch.randn(3 * cq, kw, generator=g) / 2).to(dt)
    assert attention.kda_conv_decode_fits(xq, xk, xv, state, w)
    got, want = attention.kda_conv_decode(xq, xk, xv, state, w), ref.kda_conv_decode(xq, xk, xv, state, w)
    # 16-bit: the kernel sums the rounded products in fp32 and rounds once (as CUDA's sum does); PyTorch's
    # CPU sum over the 3-4 bf16 products can round a partial sum: one ulp of the sum apart at most
    tol = dict(atol=1e-6, rtol=1e-6) if dt == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.is_contiguous()
        torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(got[3], want[3], rtol=0, atol=0)   # the shifted window: copied values
    assert not attention.kda_conv_decode_fits(xq, xk, xv, state, w[:, :2])   # state / width mismatch
    # in place (k3::kda_conv_decode_): the same q, k, v; the state itself now holds the new state
    s2 = state.clone()
    q2, k2, v2, ns2 = attention.kda_conv_decode(xq, xk, xv, s2, w, inplace=True)
    assert ns2 is s2 and not torch.equal(state, s2)
    torch.testing.assert_close(s2, want[3], rtol=0, atol=0)
    for a, b in zip((q2, k2, v2), got[:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("sort", ["0", "1"])
def test_router_topk_kernel_orders_ties_by_index_and_negative_scores_by_value(sort, monkeypatch):
    """The packed (score, index) key: biased scores below zero order as floats do (the sign trick),
    equal scores go to the lower expert index, and a NaN logit is selected first, as torch.topk
    ranks NaN above every number (both selection forms)."""
    monkeypatch.setenv("K3_KNOBS", knobs_text(router_sort=sort))
    E, k = 96, 12
    logits = torch.randn(2, E, generator=torch.Generator().manual_seed(7))
    logits[:, ::3] = 0.25                    # many exact ties
    bias = torch.linspace(-1.5, 0.2, E)      # most biased scores negative
    ids, _ = moe.router_topk(logits, bias, k, 1.0)
    biased = torch.sigmoid(logits) + bias
    order = sorted(range(E), key=lambda e: (-biased[0, e].item(), e))[:k]
    assert ids[0].tolist() == order and ids[1].tolist() == sorted(range(E), key=lambda e: (-biased[1, e].item(), e))[:k]
    logits[1, 40] = float("nan")
    ids, w = moe.router_topk(logits, bias, k, 1.0)
    assert ids[1, 0].item() == 40 and ids[0].tolist() == order


def test_mxfp4_cute_variant_falls_back_to_v3_with_reason(monkeypatch):
    """variant="cute" (the AOT-built CuTe GEMVs) cannot run on CPU: moe.mxfp4_experts runs
    CUTE_FALLBACK (Triton v3) instead, with the same result, and artifacts.fallbacks() says why."""
    g = torch.Generator().manual_seed(7)
    N, K, E, I, L = 2, 2, 3, 128, 256
    x = torch.randn(N, L, generator=g).bfloat16()
    ids = torch.randint(0, E, (N, K), generator=g, dtype=torch.int32)
    w13, s13, w2, s2 = random_experts(E, I, L, g)
    assert moe.CUTE_FALLBACK == "v3" and moe.mxfp4_experts_ok(x, ids, w13, variant="cute")
    monkeypatch.setattr(artifacts, "_WHY", {})
    out = moe.mxfp4_experts(x, ids, w13, s13, w2, s2, 4.0, 25.0, variant="cute")
    want = moe.mxfp4_experts(x, ids, w13, s13, w2, s2, 4.0, 25.0, variant="v3")
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    assert artifacts.fallbacks() == {f"mxfp4_experts I={I} L={L} K={K}": "not CUDA (the CuTe kernels are sm_90a cubins)"}


@pytest.mark.parametrize("M, I, dt", [(1, 384, torch.float32), (5, 1500, torch.float16), (3, 64, torch.float32)])
def test_situ_kernel_and_shared_expert_match_the_model(M, I, dt):
    """The shared expert's SiTU kernel equals model.functional.situ (fp32 math, rounded to the
    input dtype), and moe.situ_mlp (GEMM, kernel, GEMM) equals situ_mlp."""
    from k3compile.model.functional import situ, situ_mlp
    g = torch.Generator().manual_seed(M + I)
    gu = (torch.randn(M, 2 * I, generator=g) * 6).to(dt)
    tol = TOL[dt]
    torch.testing.assert_close(moe.situ(gu, 4.0, 25.0), situ(gu, 4.0, 25.0), **tol)
    H = 32
    x = torch.randn(M, H, generator=g).to(dt)
    wgu, wd = (torch.randn(2 * I, H, generator=g) / 4).to(dt), (torch.randn(H, I, generator=g) / 8).to(dt)
    want = situ_mlp(x, wgu, wd, 4.0, 25.0)
    torch.testing.assert_close(moe.situ_mlp(x, wgu, wd, 4.0, 25.0), want,
                               atol=tol["atol"] * want.abs().max().item() * 10, rtol=tol["rtol"])


def test_kernel_note_names_the_mxfp4_expert_kernel_and_why_not_cute(monkeypatch, tmp_path):
    """The match report's kernel note says which MXFP4 expert kernel a CUDA graph will run: the CuTe
    f16x2 GEMVs where an artifact fits (or the DSL can build it on the first call) and M is in
    tuning.CUTE_M, else Triton v3 with the reason. The note itself never builds."""
    from k3compile.kernels import cute
    from k3compile.kernels.dispatch import describe
    monkeypatch.setenv("K3_KNOBS", knobs_text(mxfp4=""))
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute=""))
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute_jit=""))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cute, "dsl_available", lambda: False)
    monkeypatch.setenv("K3_CUTE_DIR", str(tmp_path / "none"))
    monkeypatch.setattr(artifacts, "packaged_dir", lambda: tmp_path / "no_packaged")   # as without the package's
    monkeypatch.setattr(artifacts, "_FOUND", {})
    note = describe("cuda", None, (384, 3584, 16, 1, True))
    assert note.startswith("kernels: CUDA kernels, TP=1") and "MXFP4 experts: Triton v3 (no CuTe artifact directory" in note
    assert note.endswith("no JIT build: the CuTe DSL is not installed)")
    # with the DSL the first call would build the artifacts (the JIT path); the note does not
    monkeypatch.setattr(cute, "dsl_available", lambda: True)
    monkeypatch.setattr(artifacts, "_FOUND", {})
    assert describe("cuda", None, (384, 3584, 16, 1, True)).endswith(
        f"MXFP4 experts: CuTe f16x2 GEMVs (built just in time on the first call into {tmp_path / 'none'})")
    assert not (tmp_path / "none").exists() and not artifacts._FOUND
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute_jit="0"))
    assert describe("cuda", None, (384, 3584, 16, 1, True)).endswith("JIT build off (K3_KNOBS=cute_jit=0))")
    monkeypatch.setattr(artifacts, "_FOUND", {})
    assert "Triton v4g (pairs grouped by expert) (M=80; CuTe at M in [1, 79])" in describe(
        "cuda", None, (384, 3584, 16, 80, True))
    assert "Triton v2b" in describe("cuda", None, (384, 3584, 16, 1, False))
    monkeypatch.setenv("K3_KNOBS", knobs_text(mxfp4="v3"))
    assert describe("cuda", None, (384, 3584, 16, 1, True)).endswith("MXFP4 experts: v3 (K3_KNOBS mxfp4)")
    monkeypatch.setenv("K3_KNOBS", knobs_text(mxfp4=""))
    # an artifact directory with the f16x2 pair for these shapes (manifests are all the lookup reads)
    d = tmp_path / "arts"
    d.mkdir()
    import json
    for op in ("mxfp4_gate_up", "mxfp4_down"):
        (d / f"{op}.json").write_text(json.dumps({"variant": {"op": op}, "math": "f16x2",
                                                  "shapes": {"I": 384, "L": 3584, "K": 16}}))
        (d / f"{op}.cubin").write_bytes(b"")
    monkeypatch.setenv("K3_CUTE_DIR", str(d))
    monkeypatch.setattr(artifacts, "_FOUND", {})
    assert describe("cuda", None, (384, 3584, 16, 16, True)).endswith(f"MXFP4 experts: CuTe f16x2 GEMVs ({d})")
    assert "at M in [1, 79], Triton v4g above (M is dynamic)" in describe("cuda", None, (384, 3584, 16, None, True))


class _FakeCuda:  # what gemv_plan reads of a CUDA tensor: shape, dtype, strides, is_cuda, device
    def __init__(self, *shape):
        self.shape, self.dtype, self.is_cuda, self.device = shape, torch.bfloat16, True, torch.device("cuda", 0)

    def dim(self):
        return len(self.shape)

    def stride(self, i):
        return 1 if i in (1, -1) else self.shape[1]


def test_gemv_card_rows_merge_per_m(monkeypatch):
    """GEMV_TABLE_BY_CARD: the rows of the card whose key is in the GPU's name replace GEMV_TABLE's at
    the Ms they name and leave the other Ms (and shapes, and other cards) to GEMV_TABLE; K3_KNOBS gemv_card
    forces a key or turns them off; a K3_KNOBS gemv_table sweep takes precedence over them."""
    monkeypatch.setenv("K3_KNOBS", knobs_text(gemv_card=""))
    monkeypatch.setenv("K3_KNOBS", knobs_text(gemv="", gemv_table="", gemv_cfg=""))
    kin, oproj = _FakeCuda(6284, 7168), _FakeCuda(7168, 1536)
    x1, x4 = _FakeCuda(1, 7168), _FakeCuda(4, 7168)
    table = tuning.GEMV_TABLE[(6284, 7168)]
    card = tuning.GEMV_TABLE_BY_CARD["H100"][(6284, 7168)]
    assert card[1] != table[1]
    for name, m1 in (("NVIDIA H100 80GB HBM3", card[1]), ("NVIDIA H200", table[1])):
        monkeypatch.setattr(gemm, "_card_name", lambda i, name=name: name)
        assert gemm.gemv_plan(x1, kin) == gemm.parse_cfg(m1)
        assert gemm.gemv_plan(x4, kin) == gemm.parse_cfg(table[4])                 # M=4: GEMV_TABLE's
        assert gemm.gemv_plan(_FakeCuda(1, 1536), oproj) == gemm.parse_cfg(tuning.GEMV_TABLE[(7168, 1536)][1])
        # the stacked router + latent (looked up by its stacked rows): the card's GEMV at M=1 only
        router, stacked = _FakeCuda(896, 7168), tuning.GEMV_TABLE[(4480, 7168)]
        want = tuning.GEMV_TABLE_BY_CARD["H100"][(4480, 7168)][1] if "H100" in name else stacked[1]
        assert gemm.gemv_plan(x1, router, rows=4480) == gemm.parse_cfg(want)
        assert gemm.gemv_plan(_FakeCuda(2, 7168), router, rows=4480) == gemm.parse_cfg(stacked[4])
    assert isinstance(gemm.parse_cfg(tuning.GEMV_TABLE_BY_CARD["H100"][(4480, 7168)][1]), tuple)
    monkeypatch.setenv("K3_KNOBS", knobs_text(gemv_card="none"))
    assert gemm.gemv_plan(x1, kin) == gemm.parse_cfg(table[1])
    monkeypatch.setenv("K3_KNOBS", knobs_text(gemv_card="H100"))
    assert gemm.gemv_plan(x1, kin) == gemm.parse_cfg(card[1])
    monkeypatch.setenv("K3_KNOBS", knobs_text(gemv_table="sweep.json"))
    monkeypatch.setitem(gemm._TABLES, "sweep.json", {(6284, 7168): {1: "mma 32/128/1/4/6"}})
    assert gemm.gemv_plan(x1, kin) == gemm.parse_cfg("mma 32/128/1/4/6")


def test_gemv_cfg_env_forces_one_shape(monkeypatch):
    """K3_KNOBS gemv_cfg overrides the tuned table for the shapes it names (every M), "cublas" included;
    other shapes keep the table; a bad config name is an error, not a silent cuBLAS."""

    Fake = _FakeCuda
    monkeypatch.setenv("K3_KNOBS", knobs_text(gemv_card="none"))
    x, w, w2 = Fake(1, 7168), Fake(1536, 7168), Fake(7168, 1536)
    monkeypatch.setenv("K3_KNOBS", knobs_text(gemv_cfg="1536x7168=mmas 64/128/4/4/4; 896x7168=cublas"))
    assert gemm.gemv_plan(x, w) == gemm.MmaCfg(64, 128, 4, 4, 4, True)
    assert gemm.gemv_plan(x, Fake(896, 7168)) is None
    assert gemm.gemv_plan(Fake(1, 1536), w2) == gemm.parse_cfg(tuning.GEMV_TABLE[(7168, 1536)][1])
    monkeypatch.setenv("K3_KNOBS", knobs_text(gemv_cfg="1536x7168=mma 64/x"))
    with pytest.raises(ValueError):
        gemm.gemv_plan(x, w)


@pytest.mark.parametrize("dt", [torch.float32, torch.float16])
@pytest.mark.parametrize("H, M, K, N, w_nk", [(12, 1, 128, 512, False), (12, 2, 512, 128, True), (3, 17, 40, 24, False),
                                              (4, 5, 16, 33, True)])
@pytest.mark.parametrize("gated", [False, True])
def test_head_bmm_kernel_matches_bmm(dt, H, M, K, N, w_nk, gated):
    """k3::decode_bmm's kernel (the MLA absorption / value up-projection shapes at TP=8, odd sizes,
    more rows than one tile): torch.bmm's product for x [H, M, K] taken as the graph hands it (a
    permuted, non-contiguous view of [M, H, K]) and w [H, K, N] or [H, N, K] (w_nk); gated: times
    sigmoid(gate [M, H, N]) (a strided slice, as the model's gate is); stored token-major, as the op's
    reference."""
    from k3compile.ops import reference as ref_ops
    g = torch.Generator().manual_seed(H * 100 + K)
    x = torch.randn(M, H, K, generator=g).to(dt).permute(1, 0, 2)
    w = torch.randn(*((H, N, K) if w_nk else (H, K, N)), generator=g).to(dt)
    gate = torch.randn(M, H, N + 3, generator=g).to(dt)[..., 1:N + 1] if gated else None
    ref = torch.bmm(x.float(), (w.transpose(1, 2) if w_nk else w).float())
    if gated:
        ref = ref * torch.sigmoid(gate.float()).permute(1, 0, 2)
    out = gemm.head_bmm(x, w, w_nk, gate)
    want = ref_ops.decode_bmm(x, w, w_nk, gate)
    assert out.shape == want.shape == (H, M, N) and out.dtype == dt and out.stride() == want.stride()
    assert out.permute(1, 0, 2).is_contiguous()
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()   # fp32: the summation order only
    assert err < (1e-6 if dt == torch.float32 else 4e-3), err


@pytest.mark.parametrize("form", ["rows", "cols"])
@pytest.mark.parametrize("world,rank,nb,M", [(1, 0, 0, 3), (1, 0, 3, 4), (2, 1, 2, 4)])
@pytest.mark.parametrize("cast_first,key_fp32,sum_fp32", [(1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1)])
def test_norm_kernels_round_in_the_models_order(form, world, rank, nb, M, cast_first, key_fp32, sum_fp32,
                                                monkeypatch):
    """comm.ar_residual_norm with the rounding bits of a model written otherwise than the reference
    model (the post-norm rounded to the model dtype before its weight multiply; the AttnRes keys kept
    in fp32; the mixed row kept in fp32 for the output norm, as vLLM's AttnRes kernel): its outputs are those of the op's reference in that order (ops.reference.attnres_mix_as),
    within fp16's 1e-2, and closer to them than to the reference model's order wherever the two orders
    differ. The column-split kernel's keys are fp32 in either order (its docstring); its norm follows
    the bit. fp16: the interpreter rounds fp32 -> fp16 as the GPU does (bf16 it truncates)."""
    from k3compile.ops import reference as ref
    dt = torch.float16
    rounding = ref.NORM_CAST_FIRST if cast_first else 0
    mix_rounding = (ref.MIX_KEY_FP32 if key_fp32 else 0) | (ref.MIX_SUM_FP32 if sum_fp32 else 0)
    N = 200
    if form == "cols":
        monkeypatch.setattr(tuning, "COLS_W", 32)
        monkeypatch.setattr(tuning, "COLS_MIN_WORLD", 1)
        monkeypatch.setattr(tuning, "COLS_MAX_M", 4)
        monkeypatch.setattr(tuning, "COLS_MAX_TILE", 4096)
    else:
        monkeypatch.setattr(tuning, "COLS", False)
    g = torch.Generator().manual_seed(31 * nb + M + world)
    parts = [torch.randn(M, N, generator=g).to(dt) for _ in range(world)]
    resid = torch.randn(M, N, generator=g).to(dt)
    blocks = [(torch.randn(M, N, generator=g) * (1 + i)).to(dt) for i in range(nb)]
    w_norm, _, gam = _weights(N, dt, g)
    w_qk = (torch.randn(N, generator=g) * (6 / N ** 0.5)).to(dt)   # logits of a few units: a soft softmax
    sim = SimGroup(world, rank, M * N * 4) if world > 1 else None
    programs = M
    if form == "cols":
        plan = comm.cols_plan(M, N, nb + 1, sim.peers if sim else None)
        assert plan is not None
        programs = plan.programs
    if sim:
        sim.peers.programs = programs
        for p in range(world):
            if p != rank:
                sim.view(p, dt, M, N).copy_(parts[p])
        sim.arm(programs)
    upd, nrm = comm.ar_residual_norm(parts[rank], sim.peers if sim else None, resid, gam, w_norm, w_qk, blocks,
                                       1e-5, None, comm.rnd_bits(rounding, mix_rounding))
    y = sum(x.float() for x in parts).to(dt)
    want, want_upd = ref.attnres_mix_as(resid, y, blocks, w_norm, w_qk, gam, 1e-5, rounding, mix_rounding)
    other, _ = ref.attnres_mix_as(resid, y, blocks, w_norm, w_qk, gam, 1e-5, 0, 0)
    torch.testing.assert_close(upd, want_upd, **TOL[dt])
    torch.testing.assert_close(nrm, want, **TOL[dt])
    if form == "rows" or cast_first:
        assert torch.equal(want, other) or int((nrm != want).sum()) < int((nrm != other).sum()), \
            (int((nrm != want).sum()), int((nrm != other).sum()), nrm.numel())


@pytest.mark.parametrize("form", ["rows", "cols"])
@pytest.mark.parametrize("world,rank,M", [(1, 0, 3), (2, 1, 2)])
def test_latent_tail_kernel_rounds_in_the_models_order(form, world, rank, M, monkeypatch):
    """comm.latent_tail with the latent norm rounded to the model dtype before its weight multiply
    (rnd_bits(NORM_CAST_FIRST)): its ln is the reference's in that order, closer to it than to the
    reference model's order."""
    from k3compile.ops import reference as ref
    dt = torch.float16
    L, H = 136, 200
    if form == "cols":
        monkeypatch.setattr(tuning, "COLS_W", 32)
        monkeypatch.setattr(tuning, "COLS_MIN_WORLD", 1)
        monkeypatch.setattr(tuning, "COLS_MAX_M", 4)
        monkeypatch.setattr(tuning, "COLS_MAX_TILE", 4096)
    else:
        monkeypatch.setattr(tuning, "COLS", False)
    case = _TailCase(dt, world, rank, M, L=L, H=H, seed=3 * M + world)
    sim = case.sim
    plan = comm.cols_plan(M, L, 1, sim.peers if sim else None) if form == "cols" else None
    programs = plan.programs if plan is not None else M
    if sim:
        sim.peers.programs = programs
        for p in range(world):
            if p != rank:
                sim.view(p, dt, M, L).copy_(case._mine(p))
        sim.arm(programs)
    ln, _ = comm.latent_tail(case.ys[rank], case.ws, sim.peers if sim else None, case.gam, case.sp, 1e-5,
                               comm.rnd_bits(ref.NORM_CAST_FIRST))
    routed = sum(case._mine(p).float() for p in range(world)).to(dt)
    want = ref.rms_norm_as(routed, case.gam, 1e-5, ref.NORM_CAST_FIRST)
    other = ref.rms_norm_as(routed, case.gam, 1e-5, 0)
    torch.testing.assert_close(ln, want, **TOL[dt])
    assert int((ln != want).sum()) < int((ln != other).sum()), (int((ln != want).sum()), int((ln != other).sum()))
