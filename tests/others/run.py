"""Drive the three independent Kimi K3 styles: eager vs torch.compile, world 1 or world N on gloo.

    from tests.others.run import run, launch
    eager, compiled = run("hf_style", world=1, rank=0, M=3, backend="aot_eager")
    eager, compiled = launch("fused", world=2, M=3)            # rank 0's results

Each call builds the model, makes a fresh cache, runs `steps` decode steps with fixed token ids
(weights.token_ids) and returns the last step's fp32 logits [M, V] (all_steps=True: [steps, M, V]).
The compiled run starts from a fresh, identical cache.
"""
from __future__ import annotations

import importlib
import os
import socket
import tempfile

import torch
import torch.distributed as dist

from . import weights as K3W

STYLES = ("hf_style", "functional", "fused")


def style_module(style: str):
    assert style in STYLES, style
    return importlib.import_module(f"{__package__}.{style}")


def _drive(mod, cfg, rank, world, group, M, steps, backend, dtype):
    model = mod.build(cfg, rank, world, group, dtype=dtype)
    cache = model.new_cache(M)
    outs = []
    if getattr(mod, "RETURNS_CACHE", False):
        fn = mod.step if backend is None else torch.compile(mod.step, backend=backend)
        for s in range(steps):
            logits, cache = fn(model, K3W.token_ids(cfg, M, s), cache)
            outs.append(logits)
    else:
        fn = model.step if backend is None else torch.compile(model.step, backend=backend)
        for s in range(steps):
            outs.append(fn(K3W.token_ids(cfg, M, s), cache))
    return torch.stack([o.detach().clone() for o in outs])


def run(style: str, world: int = 1, rank: int = 0, M: int = 1, backend=None, steps: int = 2,
        cfg=None, group=None, dtype=torch.bfloat16, all_steps: bool = False, report: bool = False):
    """Returns (eager_logits, compiled_logits or None), and with report=True the k3 match report of
    the compile (k3compile.last_report().to_dict()) third. backend "k3-eager" is
    `k3compile.backend(mode="eager")` (a name, so that it travels to spawned ranks)."""
    mod = style_module(style)
    cfg = cfg or mod.tiny_config()
    if backend == "k3-eager":
        import k3compile
        k3compile.clear_reports()
        torch._dynamo.reset()
        backend = k3compile.backend(mode="eager")
    with torch.no_grad():
        eager = _drive(mod, cfg, rank, world, group, M, steps, None, dtype)
        compiled = None
        if backend is not None:
            compiled = _drive(mod, cfg, rank, world, group, M, steps, backend, dtype)
    if not all_steps:
        eager = eager[-1]
        compiled = None if compiled is None else compiled[-1]
    if report:
        import k3compile
        rep = k3compile.last_report()
        return eager, compiled, rep.to_dict() if rep is not None else None
    return eager, compiled


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, jobs, out_path, fn=None):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = [(fn or run)(world=world, rank=rank, **job) for job in jobs]
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()


def launch_many(jobs: list[dict], world: int = 2, fn=None) -> list:
    """Run each job (kwargs of `fn`, default `run`, other than world/rank; fn a module-level function)
    on `world` gloo ranks started by torch.multiprocessing (k3compile.distributed.rank_start_method) on
    127.0.0.1; returns rank 0's results."""
    import torch.multiprocessing as mp

    from k3compile.distributed import rank_start_method
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rank0.pt")
        mp.start_processes(_worker, args=(world, free_port(), jobs, out, fn), nprocs=world,
                           join=True, start_method=rank_start_method())
        return torch.load(out)


# Sites every role-anchored pass must match on the 4-layer decoders (KDA dense, KDA MoE, MLA MoE,
# KDA MoE): per layer, per MoE layer; the residual norm once per MLP / MoE add (each layer input but
# the first, and the final norm)
LAYERS, MOE = 4, 3
EXPECTED = {"fuse_oproj_allreduce": LAYERS, "fuse_residual_norm": LAYERS, "fuse_router_topk": MOE,
            "fold_moe_finalize": MOE, "shard_router_latent": MOE, "overlap_shared_expert": MOE}


def launch(style: str, world: int = 2, M: int = 1, backend=None, steps: int = 2, **kw):
    return launch_many([dict(style=style, M=M, backend=backend, steps=steps, **kw)], world)[0]
