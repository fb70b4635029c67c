"""Launch a function on N local ranks (gloo on CPU, NCCL on GPU) with torch.multiprocessing.

Used by the tests and the CLI (`k3c run --tp N`): `run_ranks(fn, world, *args)` returns each rank's
return value (rank order). The function must be importable (module-level).
"""
from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .config import environment


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_SERVER_ENV: list[dict[str, str]] = []   # the environment the fork server started with (set once)


def rank_start_method() -> str:
    """The multiprocessing start method of the rank processes: a fork server that has imported torch and
    Dynamo once (each rank then starts in well under a second instead of re-importing them, about 4 s
    of CPU), or spawn where the platform has no fork server. The server's modules read the environment
    when it imported them (Triton's TRITON_INTERPRET, torch's TORCH_LOGS), so ranks fork from it only
    while the environment is the one it started with; after a change they are spawned."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    env = environment()
    if not _SERVER_ENV:
        _SERVER_ENV.append(env)
        mp.get_context("forkserver").set_forkserver_preload(["torch", "torch._dynamo"])
    return "forkserver" if env == _SERVER_ENV[0] else "spawn"


def _worker(rank, world, port, backend, fn, args, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        out = fn(rank, world, *args)
        q.put((rank, True, out))
    except BaseException as e:  # report to the parent instead of hanging it
        q.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, backend: str | None = None, fresh: bool = False, timeout: float = 600):
    if world == 1:
        return [fn(0, 1, *args)]
    backend = backend or ("nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo")
    # fresh: new interpreters (a rank function that sets the environment or patches modules before it
    # imports them: nothing imported yet)
    ctx = mp.get_context("spawn" if fresh else rank_start_method())
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, backend, fn, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, ok, out = q.get(timeout=timeout)
            (results.__setitem__(rank, out) if ok else errors.append(f"rank {rank}: {out}"))
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("a rank failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world)]
