"""A TP group's other ranks simulated on one device, for the communication kernels' tests and
single-GPU benches: every rank's symmetric buffer and signal pad is an ordinary tensor on
`device`, and the peers' barrier signals are written into this rank's pad beforehand (`arm`), as
if they had reached the barrier first. What peers' GEMMs would have stored goes into their
buffers through `view`. The kernels then run exactly as on a real group, minus NVLink.
"""
from __future__ import annotations

import torch

from k3compile.kernels import comm
from k3compile.runtime.symm import max_programs


class SimGroup:
    """Rank `rank` of `world`, every buffer and signal pad a tensor on `device`."""

    def __init__(self, world: int, rank: int, nbytes: int, pad_bytes: int = 2048, flag_bytes: int = 0,
                 device: str | torch.device = "cpu"):
        """nbytes: one buffer half; flag_bytes: the push-flag region after the two halves."""
        self.world, self.rank, self.nbytes = world, rank, 2 * nbytes
        self.bufs = [torch.zeros(2 * nbytes + flag_bytes, dtype=torch.uint8, device=device) for _ in range(world)]
        self.pads = [torch.zeros(pad_bytes // 4, dtype=torch.int32, device=device) for _ in range(world)]
        self.epoch = torch.zeros(3, dtype=torch.int32, device=device)
        self.peers = comm.Peers(torch.tensor([b.data_ptr() for b in self.bufs], device=device),
                                  torch.tensor([p.data_ptr() for p in self.pads], device=device), self.epoch, rank,
                                  world, self.nbytes, max_programs(pad_bytes, world),
                                  2 * nbytes if flag_bytes else -1)

    def view(self, p, dtype, *shape, half=None):
        """Rank p's buffer half (default: the one the next call uses), as [*shape] of dtype."""
        n = 1
        for s in shape:
            n *= s
        off = (int(self.epoch[0]) if half is None else half) * self.peers.half(dtype)
        return self.bufs[p].view(dtype)[off:off + n].view(*shape)

    def arm(self, programs: int, calls: int = 1):
        """The peers' signals to this rank for the next call: its sequence number (SEQ barrier) or
        1 (CAS handshake). calls > 1 (SEQ barrier only): a number `calls - 1` ahead, which lets
        that many calls pass (a graph replayed many times: the wait is `slot - seq >= 0`)."""
        v = int(self.epoch[2]) + calls if comm.SEQ_BARRIER else 1
        for pid in range(programs):
            for p in range(self.world):
                if p != self.rank:
                    self.pads[self.rank][pid * self.world + p] = v

    def check_signals(self, programs: int, epoch_before: int):
        seq = int(self.epoch[2])  # the call just made
        if comm.SEQ_BARRIER:   # the slots keep the last sequence number; nothing is consumed
            assert all(int(self.pads[self.rank][pid * self.world + p]) == seq
                       for pid in range(programs) for p in range(self.world) if p != self.rank)
        else:
            assert int(self.pads[self.rank].abs().sum()) == 0, "this rank did not consume every signal"
        for p in range(self.world):
            if p == self.rank:
                continue
            want = torch.zeros_like(self.pads[p])
            for pid in range(programs):
                want[pid * self.world + self.rank] = seq if comm.SEQ_BARRIER else 1
            assert torch.equal(self.pads[p], want), f"signals sent to rank {p}"
            self.pads[p].zero_()  # the peer consumes them
        assert self.epoch[:2].tolist() == [1 - epoch_before, 0], "the buffer half did not flip"


def _rnd(g, device, dtype, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)


def _group_holding(parts: list[torch.Tensor], device) -> SimGroup:
    """Rank 0 of a group of len(parts): rank p's partial parts[p] [M, width] in both halves of its
    buffer, and this rank's pad armed for 2^20 calls."""
    M, width = parts[0].shape
    sim = SimGroup(len(parts), 0, max(M * width * 4, 1 << 16), device=device)
    for p in range(1, len(parts)):
        for h in (0, 1):
            sim.view(p, parts[p].dtype, M, width, half=h).copy_(parts[p])
    sim.arm(sim.peers.programs, calls=1 << 20)
    return sim


def _mixer_case(g, world: int, M: int, N: int, nblocks: int, dtype, device, mine):
    """What the o-proj and layer-input cases share: residual, AttnRes blocks and weights, the
    partials (this rank's from mine(), the peers' random) held by a simulated group, and the
    reference (updated, normed) over them."""
    from k3compile.model.functional import attnres_mix
    res = _rnd(g, device, dtype, M, N)
    blocks = [_rnd(g, device, dtype, M, N) for _ in range(nblocks)]
    w_norm, w_qk, gam = ((torch.rand(N, generator=g, device=device) + 0.5).to(dtype) for _ in range(3))
    parts = [mine()] + [_rnd(g, device, dtype, M, N, scale=0.5) for _ in range(world - 1)]
    sim = _group_holding(parts, device)
    y = sum(t.float() for t in parts).to(dtype)
    ref = attnres_mix(res, y, blocks, w_norm, w_qk, gam, 1e-5)[::-1]   # (updated, normed)
    return res, blocks, w_norm, w_qk, gam, parts, sim, ref


def oproj_case(world: int, M: int, nblocks: int = 0, K: int = 1536, N: int = 7168, dtype=torch.bfloat16,
               device="cuda", seed: int = 0, copies: int = 1):
    """The o-proj op on rank 0 of a simulated group: returns (run, reference, sim). run() calls
    comm.oproj (the GEMM, then the all-reduce + residual + norm kernel) on the next of `copies`
    weight copies (the same values: copies > 1 keeps them out of L2 for benches); reference =
    (updated, normed) from the model's functions over the same partials. Every peer's partial is
    in both halves of its buffer; the pad is armed for 2^20 calls. world=1: no peers (TP=1).
    run() refers to `sim`: the kernels address its buffers by raw pointer, so they must outlive
    every call (and every CUDA graph that captured one)."""
    import torch.nn.functional as F
    g = torch.Generator(device=device).manual_seed(seed)
    x = _rnd(g, device, dtype, M, K)
    w = _rnd(g, device, dtype, N, K, scale=K ** -0.5)
    res, blocks, w_norm, w_qk, gam, _, sim, ref = _mixer_case(g, world, M, N, nblocks, dtype, device,
                                                              lambda: F.linear(x, w))
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    it = iter(range(1 << 62))

    def run():
        return comm.oproj(x, ws[next(it) % copies], sim.peers if world > 1 else None, res, blocks,
                            w_norm if blocks else None, w_qk if blocks else None, gam, 1e-5)
    return run, ref, sim


def residual_norm_case(world: int, M: int, nblocks: int = 3, N: int = 7168, dtype=torch.bfloat16, device="cuda",
                       seed: int = 0):
    """The layer-input op (k3::residual_norm: all-reduce of delta + residual + AttnRes / RMSNorm) on rank 0
    of a simulated group, as oproj_case without the GEMM: run() calls comm.residual_norm."""
    g = torch.Generator(device=device).manual_seed(seed)
    res, blocks, w_norm, w_qk, gam, parts, sim, ref = _mixer_case(
        g, world, M, N, nblocks, dtype, device, lambda: _rnd(g, device, dtype, M, N, scale=0.5))

    def run():
        return comm.residual_norm(parts[0], sim.peers if world > 1 else None, res, blocks,
                                    w_norm if blocks else None, w_qk if blocks else None, gam, 1e-5)
    return run, ref, sim


def tail_case(world: int, M: int, L: int = 3584, H: int = 7168, up: int = 896, topk: int = 16,
              dtype=torch.bfloat16, device="cuda", seed: int = 0, copies: int = 1):
    """The latent-tail op on rank 0 of a simulated group, as oproj_case: run() calls comm.moe_tail
    (finalize + all-reduce + RMSNorm kernel, then the up-projection shard [up, L] into columns
    [0, up) of the shared partial); reference from PyTorch over the same partials."""
    import torch.nn.functional as F
    from k3compile.model.functional import rms_norm
    g = torch.Generator(device=device).manual_seed(seed)
    y = _rnd(g, device, dtype, M, topk, L)
    tw = torch.softmax(torch.randn(M, topk, generator=g, device=device), -1)
    sp = _rnd(g, device, dtype, M, H)
    gam = (torch.rand(L, generator=g, device=device) + 0.5).to(dtype)
    w_up = _rnd(g, device, dtype, up, L, scale=L ** -0.5)
    mine = (y.float() * tw.unsqueeze(-1)).sum(1).to(dtype)
    parts = [mine] + [_rnd(g, device, dtype, M, L, scale=0.5) for _ in range(world - 1)]
    sim = _group_holding(parts, device)
    routed = sum(t.float() for t in parts).to(dtype)
    ref = sp.clone()
    ref[:, :up] = (sp[:, :up].float() + F.linear(rms_norm(routed, gam, 1e-5), w_up).float()).to(dtype)
    ws = [w_up] + [w_up.clone() for _ in range(copies - 1)]
    it = iter(range(1 << 62))

    def run():
        return comm.moe_tail(y, tw, sim.peers if world > 1 else None, sp, gam, ws[next(it) % copies], 1e-5, 0)
    return run, ref, sim
