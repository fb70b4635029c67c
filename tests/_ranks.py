"""Rank functions for the multi-process tests (tests/ is not a package, so they live here).

`run_ranks` spawns fresh interpreters; spawn hands them the parent's sys.path, which holds
tests/ (pytest's default "prepend" import mode puts it there), so `_ranks` imports by name.
Results go back through a multiprocessing queue: return plain numpy arrays / strings, never
torch tensors (a tensor is sent as a shared-memory handle that dies with the rank process).
"""
from __future__ import annotations

import torch

from k3compile.model import K3Cache, K3Config, K3Model, TPInfo


def _err(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return "no error"


def tp_decode(rank: int, world: int, cfg: K3Config, prompt: torch.Tensor, steps: torch.Tensor) -> dict:
    """Prefill `prompt` [M, T], then decode `steps` [S, M] on TP=world; also probe TP errors."""
    tp = TPInfo.current(world)
    assert tp.size == world and tp.rank == rank
    model = K3Model(cfg, tp)
    cache = model.new_cache(prompt.shape[0])
    logits = [model.prefill(prompt, cache)]
    for tok in steps:
        logits.append(model.decode(tok, cache))
    return {
        "logits": [x.numpy() for x in logits],
        "kv": {i: v.numpy() for i, v in cache.kv.items()},
        "state": {i: v.numpy() for i, v in cache.state.items()},
        "seq_lens": cache.seq_lens.numpy(),
        # a cache made for TP=1 handed to the TP=world model
        "err_cache_tp": _err(lambda: model.decode(steps[0], K3Cache(cfg, prompt.shape[0]))),
        # asking for a TP size other than the world
        "err_tp_world": _err(lambda: TPInfo.current(world + 1)),
    }
