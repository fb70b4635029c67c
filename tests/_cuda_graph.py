"""A helper of the GPU tests of stateful ops."""
from __future__ import annotations

import torch


def replay_once(call, *states0: torch.Tensor):
    """Capture call(*states) in a CUDA graph on copies of states0, put states0 back into the copies
    (in case anything ran during the capture), replay once: (the graph's output, the states it left;
    one tensor where one state was given)."""
    sts = [s.clone() for s in states0]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(*sts)
    for s, s0 in zip(sts, states0):
        s.copy_(s0)
    graph.replay()
    torch.cuda.synchronize()
    return out, (sts[0] if len(sts) == 1 else sts)
