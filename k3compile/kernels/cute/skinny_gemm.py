"""Skinny bf16 GEMM for decode on sm_90a (CuTe DSL): out[M, N] = x[M, K] @ w[N, K]^T, M <= 64.

Swap-AB: the weight is wgmma's A operand (64 rows of N per CTA, the instruction's M), the tokens
are its B operand (the instruction's N = MT in {8, 16, 32, 64}), so a decode batch of M tokens is
not padded to a 64-row tile: a CTA reads a 64 x K slab of the weight once (the op is bound by those
bytes) and multiplies it with all MT token rows. Both operands are K-major in global memory; TMA
loads 64 x BK (weight) and MT x BK (tokens) tiles with the 128-byte swizzle into an S-stage
mbarrier pipeline (PipelineTmaAsync); one warpgroup issues wgmma.mma_async (fp32 accumulators)
on stage s while TMA fills the next stages. Warp 0 of the same warpgroup issues the TMA loads (not
warp-specialised: with one 64-row CTA per SM-slot the producer has nothing to overlap that the
deep pipeline does not already cover). Rows of x beyond M are zero-filled by TMA (the descriptor's
row count is the real M) and not stored: the epilogue stores accumulators straight from registers
to out with a row predicate m < m_valid.

Grid: N / 64 CTAs (112 for N = 7168). The DSL is imported by whoever imports this module; the
package itself never imports it (see `k3compile.kernels.cute.__init__`).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, Int64

from .ptx import fence_acq_rel_sys, ld_relaxed_s32, ld_u64, lds_v4, st_release_sys_u32, st_v4, sts_bf16

BN = 64       # weight rows per CTA (wgmma M)
BK = 64       # K per stage: 4 wgmma K-steps of 16 (bf16), 128-byte rows -> 128B swizzle


@cute.jit
def _load_stage(pipe, prod, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB):
    """Producer step: wait for a free stage, TMA-load k-tile `prod.count` of the weight and the
    tokens into stage `prod.index`, arm its barrier with the bytes to expect."""
    pipe.producer_acquire(prod)
    bar = pipe.producer_get_barrier(prod)
    cute.copy(tma_a, tAgA[(None, prod.count)], tAsA[(None, prod.index)], tma_bar_ptr=bar)
    cute.copy(tma_b, tBgB[(None, prod.count)], tBsB[(None, prod.index)], tma_bar_ptr=bar)
    pipe.producer_commit(prod)


class SkinnyGemmSm90:
    def __init__(self, mt: int = 16, stages: int = 8):
        assert mt in (8, 16, 32, 64), mt
        self.mt = mt
        self.stages = stages
        self.tile = (BN, mt, BK)
        self.threads = 128
        self.acc_dtype = cutlass.Float32

    @cute.jit
    def __call__(self, w: cute.Tensor, x: cute.Tensor, out_t: cute.Tensor, m_valid: cutlass.Int32,
                 stream: cuda.CUstream):
        """w: (N, K) K-major; x: (MT, K) K-major; out_t: out viewed as (N, MT), stride (1, N)."""
        tiled_mma, a_smem, b_smem, tma_a, g_a, tma_b, g_b = self._host_setup(w, x, c_tile=False)
        n_tiles = cute.ceil_div(w.shape[0], BN)
        self.kernel(tma_a, g_a, tma_b, g_b, out_t, m_valid, tiled_mma, a_smem, b_smem).launch(
            grid=(n_tiles, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.jit
    def _host_setup(self, w: cute.Tensor, x: cute.Tensor, c_tile: cutlass.Constexpr):
        """Host side of both kernels (traced inside __call__): the MMA, the
        two swizzled shared-memory layouts, the TMA atoms of w and x, and the shared storage type
        (`self.smem_t`; c_tile: plus the (MT, 64) bf16 output tile of the push epilogue)."""
        ab = w.element_type
        self.ab = ab
        self.n = w.shape[0]
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            ab, ab, utils.LayoutEnum.from_tensor(w).sm90_mma_major_mode(),
            utils.LayoutEnum.from_tensor(x).sm90_mma_major_mode(), self.acc_dtype, (1, 1, 1),
            tiler_mn=(BN, self.mt))
        a_smem = sm90_utils.make_smem_layout_a(utils.LayoutEnum.from_tensor(w), self.tile, ab, self.stages)
        b_smem = sm90_utils.make_smem_layout_b(utils.LayoutEnum.from_tensor(x), self.tile, ab, self.stages)
        tma_a, g_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), w, cute.slice_(a_smem, (None, None, 0)), (BN, BK))
        tma_b, g_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), x, cute.slice_(b_smem, (None, None, 0)), (self.mt, BK))
        c_elems = self.mt * BN if c_tile else 8   # 8: a 16-byte stub the plain kernel never touches

        @cute.struct
        class Smem:
            bars: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(b_smem)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[ab, c_elems], 16]

        self.smem_t = Smem
        return tiled_mma, a_smem, b_smem, tma_a, g_a, tma_b, g_b

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               mC: cute.Tensor, m_valid: cutlass.Int32, tiled_mma: cute.TiledMma,
               a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        st = cutlass.memory.SmemAllocator().allocate(self.smem_t)
        acc = self._mainloop(tma_a, mA, tma_b, mB, tiled_mma, a_smem, b_smem, st)
        # epilogue: registers -> out, rows m >= m_valid dropped
        thr = tiled_mma.get_slice(tidx)
        tCgC = thr.partition_C(cute.local_tile(mC, self.tile, (bidx, 0, None), proj=(1, 1, None)))
        tCcC = thr.partition_C(cute.local_tile(cute.make_identity_tensor(mC.shape), self.tile, (bidx, 0, None),
                                               proj=(1, 1, None)))
        for i in cutlass.range_constexpr(cute.size(acc)):
            if tCcC[i][1] < m_valid:
                tCgC[i] = acc[i].to(mC.element_type)

    @cute.jit
    def _mainloop(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
                  tiled_mma: cute.TiledMma, a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout, st):
        """This CTA's (BN, MT) tile of x @ w^T in fp32 registers (the MMA's C partition); `st` is
        the allocated shared storage (bars, sA, sB)."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)

        tx = cute.size_in_bytes(self.ab, cute.slice_(a_smem, (None, None, 0))) + \
            cute.size_in_bytes(self.ab, cute.slice_(b_smem, (None, None, 0)))
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.bars.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads // 32),
            tx_count=tx, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
        sA = st.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = st.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)

        coord = (bidx, 0, None)
        gA = cute.local_tile(mA, self.tile, coord, proj=(1, None, 1))   # (BN, BK, k_tiles)
        gB = cute.local_tile(mB, self.tile, coord, proj=(None, 1, 1))   # (MT, BK, k_tiles)

        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))

        thr = tiled_mma.get_slice(tidx)
        tCrA = tiled_mma.make_fragment_A(thr.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr.partition_B(sB))
        acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C((BN, self.mt)), self.acc_dtype)
        cute.arch.sync_threads()

        k_tiles = cute.size(gA, mode=[2])
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        if warp == 0:
            for _ in cutlass.range(cutlass.min(self.stages, k_tiles), unroll=1):
                _load_stage(pipe, prod, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB)
                prod.advance()

        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        kblocks = cute.size(tCrA, mode=[2])
        for _ in cutlass.range(k_tiles, unroll=1):
            pipe.consumer_wait(cons)
            cute.nvgpu.warpgroup.fence()
            for kb in cutlass.range(kblocks, unroll_full=True):
                c = (None, None, kb, cons.index)
                cute.gemm(tiled_mma, acc, tCrA[c], tCrB[c], acc)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(0)
            pipe.consumer_release(cons)
            cons.advance()
            if warp == 0 and prod.count < k_tiles:
                _load_stage(pipe, prod, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB)
                prod.advance()
        return acc


class SkinnyGemmPushSm90(SkinnyGemmSm90):
    """The skinny GEMM with a push all-reduce epilogue: the o-proj partial of this rank goes
    straight from the GEMM into every rank's symmetric buffer, and a per-tile flag tells each peer
    it is there, so the all-reduce kernel after it (triton_comm.ar_residual_norm_kernel, PUSHED=1)
    reads only its own memory and waits on flags instead of a barrier plus a round of NVLink loads.

    Layout (every rank's symmetric buffer, bf16 elements; `half` = epoch[0], the buffer half this
    call uses, `half_elems` its size): element half * half_elems + (src * M + m) * N + n holds rank
    src's partial out[m, n]. Flags: int32 at byte offset flag_off of every rank's buffer;
    flag[src * 128 + t] = this call's sequence number (epoch[2] + 1) once rank src's column tile t
    (columns 64t .. 64t + 63) has been stored there. N / 64 <= 128 tiles.

    Epilogue of each CTA (one 64-column tile, M <= MT token rows): the fp32 accumulators, rounded
    to bf16, go to a row-major (MT, 64) tile in shared memory; then 16-byte vectors of its M valid
    rows are stored to every rank's buffer (own included: plain stores; peers: over NVLink). Every
    thread fences at system scope, the CTA meets at a barrier, and thread p (p < world, p != rank)
    stores the flag into rank p's buffer with a system-scope release.
    """

    @cute.jit
    def __call__(self, w: cute.Tensor, x: cute.Tensor, ptrs: Int64, epoch: Int64, m_valid: Int32, rank: Int32,
                 world: Int32, half_elems: Int64, flag_off: Int64, stream: cuda.CUstream):
        """w: (N, K) K-major; x: (MT, K) K-major; ptrs: device address of int64[world] (every
        rank's buffer address); epoch: device address of the workspace's int32[3]."""
        tiled_mma, a_smem, b_smem, tma_a, g_a, tma_b, g_b = self._host_setup(w, x, c_tile=True)
        n_tiles = cute.ceil_div(w.shape[0], BN)
        self.push_kernel(tma_a, g_a, tma_b, g_b, ptrs, epoch, m_valid, rank, world, half_elems, flag_off,
                         tiled_mma, a_smem, b_smem).launch(grid=(n_tiles, 1, 1), block=(self.threads, 1, 1),
                                                           stream=stream)

    @cute.kernel
    def push_kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
                    ptrs: Int64, epoch: Int64, m_valid: Int32, rank: Int32, world: Int32, half_elems: Int64,
                    flag_off: Int64, tiled_mma: cute.TiledMma, a_smem: cute.ComposedLayout,
                    b_smem: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        st = cutlass.memory.SmemAllocator().allocate(self.smem_t)
        acc = self._mainloop(tma_a, mA, tma_b, mB, tiled_mma, a_smem, b_smem, st)

        # 1. accumulators -> bf16 tile (MT rows of 64 columns, row-major) in shared memory
        thr = tiled_mma.get_slice(tidx)
        tCcC = thr.partition_C(cute.local_tile(cute.make_identity_tensor((self.n, self.mt)), self.tile,
                                               (bidx, 0, None), proj=(1, 1, None)))
        s_c = st.sC.data_ptr().toint()
        n0 = bidx * BN
        for i in cutlass.range_constexpr(cute.size(acc)):
            n, m = tCcC[i]
            if m < m_valid:
                sts_bf16(s_c + (m * BN + n - n0) * 2, acc[i])
        cute.arch.sync_threads()

        # 2. the M valid rows, 16 bytes per thread and step, into every rank's buffer
        half = Int64(ld_relaxed_s32(epoch))
        seq = ld_relaxed_s32(epoch + 8) + 1
        base = half * half_elems + Int64(rank * m_valid) * self.n + Int64(n0)
        for idx in cutlass.range(tidx, m_valid * (BN // 8), self.threads, unroll=1):
            m = idx // (BN // 8)
            c = idx % (BN // 8)
            v = lds_v4(s_c + m * (BN * 2) + c * 16)
            off = (base + Int64(m) * self.n + Int64(c * 8)) * 2
            for p in cutlass.range(world, unroll=1):
                st_v4(ld_u64(ptrs + Int64(p) * 8) + off, v[0], v[1], v[2], v[3])

        # 3. publish: fence, CTA barrier, one release store of the flag per peer
        fence_acq_rel_sys()
        cute.arch.sync_threads()
        if tidx < world and tidx != rank:
            flag = ld_u64(ptrs + Int64(tidx) * 8) + flag_off + Int64(rank * 128 + bidx) * 4
            st_release_sys_u32(flag, seq)
