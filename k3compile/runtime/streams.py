"""What one op call leaves on a stream for a later one: the side stream's work.

Fork: the side stream waits for the current stream, runs the work, records an event; the result
is remembered by its data pointer. Join: the current stream waits for that event. Both are
legal inside CUDA-graph capture (fork/join through events), so they survive `reduce-overhead`.

(The PDL pairing of the TP=1 norm kernel and the GEMV after it is not runtime state: the pass
pair_pdl sets it as arguments of the two ops.)
"""
from __future__ import annotations

import torch

_SIDE: dict[int, torch.cuda.Stream] = {}
_PENDING: dict[int, torch.cuda.Event] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE:
        _SIDE[idx] = torch.cuda.Stream(device=idx)
    return _SIDE[idx]


def fork(fn, *args: torch.Tensor | object) -> torch.Tensor:
    """Run fn(*args) on the side stream; the returned tensor must be joined before it is read."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    cur = torch.cuda.current_stream(tensors[0].device)
    side = side_stream(tensors[0].device)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        out = fn(*args)
        ev = torch.cuda.Event()
        ev.record(side)
    for t in tensors:  # inputs are in use on the side stream until the event
        t.record_stream(side)
    out.record_stream(cur)  # allocated on the side stream, read on the current one
    _PENDING[out.data_ptr()] = ev
    return out


def join(x: torch.Tensor) -> bool:
    """Make the current stream wait for the side-stream work that produced x (if any)."""
    ev = _PENDING.pop(x.data_ptr(), None)
    if ev is None:
        return False
    torch.cuda.current_stream(x.device).wait_event(ev)
    return True
