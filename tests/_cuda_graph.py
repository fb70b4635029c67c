"""A helper of the GPU tests of stateful ops."""
from __future__ import annotations

import torch


def replay_once(call, state0: torch.Tensor):
    """Capture call(state) in a CUDA graph on a copy of state0 (the capture's warm-up moves it), put
    state0 back into the copy, replay once: (the graph's output, the state it left)."""
    st = state0.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(st)
    st.copy_(state0)
    graph.replay()
    torch.cuda.synchronize()
    return out, st
