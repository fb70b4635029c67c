"""Symmetric-memory workspaces for the fused communication kernels.

One workspace per (TP group, device): a byte buffer allocated once with
`torch.distributed._symmetric_memory.empty`, rendezvoused over the group, plus two small device
tables the Triton kernels read: every rank's buffer address and every rank's signal-pad address.
Peers' buffers are read with plain loads over NVLink (P2P); no NVLink multicast is used.

The buffer is sized for the largest M the kernels serve (K3_SYMM_BYTES, default 16 MiB: two
alternating halves, each holding M=256 rows of 7168 fp32 values). An int pair beside it
(`epoch`) says which half the next call uses. A call that does not fit, a group without
symmetric memory, or a first allocation attempted inside CUDA-graph capture falls back to the
NCCL + separate-kernel path; `status()` holds each group's reason, which the compile report
quotes. Workspaces live until `release()` (registered with atexit) or process exit.
"""
from __future__ import annotations

import atexit
from ..config import env, knob
from dataclasses import dataclass

import torch

DEFAULT_BYTES = int(env("K3_SYMM_BYTES") or 16 << 20)
# the last FLAG_BYTES of the buffer: per-tile flags of the CuTe push GEMM (int32 [world, 128] per
# rank; zeroed at allocation), outside the two data halves
FLAG_BYTES = 64 << 10
# programs per kernel x world must fit the signal pad (uint32 slots): at most this many programs
MAX_PROGRAMS = 128


def max_programs(pad_bytes: int, world: int) -> int:
    return max(1, min(MAX_PROGRAMS, pad_bytes // (4 * world)))


@dataclass
class Workspace:
    group: str
    rank: int
    world: int
    buf: torch.Tensor          # uint8 [nbytes], this rank's symmetric buffer
    ptrs: torch.Tensor         # int64 [world] on device: every rank's buffer address
    pads: torch.Tensor         # int64 [world] on device: every rank's signal-pad address
    epoch: torch.Tensor        # int32 [3] on device: which buffer half the next call uses, arrival count,
                               # calls so far (the barrier's sequence number)
    programs: int              # most programs one kernel may use (signal-pad slots / world)
    handle: object

    @property
    def data_bytes(self) -> int:
        """The two alternating data halves; the push flags follow them (FLAG_BYTES)."""
        return (self.buf.numel() - FLAG_BYTES) // 32 * 32   # halves of a multiple of 16 bytes

    @property
    def flag_off(self) -> int:
        """Byte offset of the push flags: the last FLAG_BYTES of the buffer."""
        return self.buf.numel() - FLAG_BYTES

    def fits(self, nbytes: int) -> bool:
        """A call's partial must fit one half of the buffer (the halves alternate)."""
        return nbytes <= self.data_bytes // 2


_WS: dict[tuple[str, int], Workspace] = {}
_WHY: dict[str, str] = {}  # group -> why it has no workspace


def note_unavailable(key: str, why: str) -> None:
    """Record why symmetric memory could not serve a call (`key`: the group, or "group/what"); the first
    reason for a key is kept (status() lists them)."""
    _WHY.setdefault(key, why)


def unavailable_reason(group: str | None) -> str | None:
    """Why symmetric memory cannot serve `group` (None: it can, or may once allocated)."""
    if not group:
        return "no TP group"
    if group in _WHY:
        return _WHY[group]
    if knob("symm", "1") == "0":
        return "K3_KNOBS=symm=0"
    if not torch.cuda.is_available():
        return "no CUDA"
    try:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as _symm_mem  # noqa: F401  (importable?)
        if not dist.is_initialized():
            return "torch.distributed is not initialised"
        pg = dist.distributed_c10d._resolve_process_group(group)
        if "nccl" not in str(dist.get_backend(pg)).lower():
            return f"group {group} uses backend {dist.get_backend(pg)}, not NCCL"
    except Exception as e:  # noqa: BLE001
        return f"symmetric memory unavailable: {type(e).__name__}: {e}"
    return None


def workspace(group: str, device: torch.device) -> Workspace | None:
    """The group's workspace, allocating it on first use (a collective: every rank calls it at the
    same point of the same graph). None when unavailable; the reason is in `status()`."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (group, idx)
    ws = _WS.get(key)
    if ws is not None:
        return ws
    why = unavailable_reason(group)
    if why:
        _WHY.setdefault(group, why)
        return None
    if torch.cuda.is_current_stream_capturing():
        _WHY[group] = "first use was inside CUDA-graph capture (allocate by running once before capture)"
        return None
    try:
        import torch.distributed._symmetric_memory as symm_mem
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            try:
                symm_mem.enable_symm_mem_for_group(group)
            except Exception:  # noqa: BLE001  (deprecated / no-op in newer torch)
                pass
        if hasattr(symm_mem, "set_signal_pad_size") and _signal_pad_bytes(symm_mem, None) < 4 * MAX_PROGRAMS * 8:
            symm_mem.set_signal_pad_size(4 * MAX_PROGRAMS * 8)  # room for 128 programs at TP=8
        buf = symm_mem.empty(DEFAULT_BYTES, dtype=torch.uint8, device=torch.device("cuda", idx))
        hdl = symm_mem.rendezvous(buf, group)
        pads_bytes = _signal_pad_bytes(symm_mem, hdl)
        dev = buf.device
        ws = Workspace(group, hdl.rank, hdl.world_size, buf,
                       torch.tensor(list(hdl.buffer_ptrs), dtype=torch.int64, device=dev),
                       torch.tensor(list(hdl.signal_pad_ptrs), dtype=torch.int64, device=dev),
                       torch.zeros(3, dtype=torch.int32, device=dev),
                       max_programs(pads_bytes, hdl.world_size), hdl)
        buf.zero_()
        torch.cuda.synchronize(dev)
    except Exception as e:  # noqa: BLE001
        _WHY[group] = f"symmetric-memory allocation failed: {type(e).__name__}: {e}"
        ws = None
    # every rank must take the same path (a rank in the one-shot barrier while another runs NCCL
    # would hang): agree on success and on the smallest program count
    try:
        import torch.distributed as dist
        agree = torch.tensor([1 if ws else 0, ws.programs if ws else 0], dtype=torch.int64,
                             device=torch.device("cuda", idx))
        dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=dist.distributed_c10d._resolve_process_group(group))
        ok, programs = (int(v) for v in agree.tolist())
    except Exception as e:  # noqa: BLE001
        ok, programs = 0, 0
        _WHY.setdefault(group, f"ranks could not agree on symmetric memory: {type(e).__name__}: {e}")
    if not ok:
        _WHY.setdefault(group, "symmetric-memory allocation failed on another rank")
        return None
    ws.programs = programs
    _WS[key] = ws
    return ws


def _signal_pad_bytes(symm_mem, hdl) -> int:
    if hasattr(symm_mem, "get_signal_pad_size"):
        return int(symm_mem.get_signal_pad_size())
    v = getattr(hdl, "signal_pad_size", 2048) if hdl is not None else 2048
    return int(v) if isinstance(v, int) else 2048


def status() -> dict[str, str]:
    """group -> 'symmetric memory (N bytes, world W)' or the reason it falls back to NCCL."""
    out = {g: f"symmetric memory ({ws.buf.numel()} bytes, world {ws.world})" for (g, _), ws in _WS.items()}
    out.update({g: f"NCCL fallback: {why}" for g, why in _WHY.items() if g not in out})
    return out


def release() -> None:
    _WS.clear()
    _WHY.clear()


atexit.register(release)
