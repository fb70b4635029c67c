"""What every benchmark script shares: CUDA-graph timing, the memory ceiling, a variant's environment,
and how a result is saved (with the command, date, GPU and commit).

The commit: `K3_COMMIT` if set, else the file `.k3_commit` in the repository root (write it with
`git rev-parse --short HEAD > .k3_commit` right before a device call and name it in `carry`: the
device machine's copy of the tree has no reliable git history), else `git rev-parse`, else "unknown".
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class GraphTimer:
    """`reps` calls of fn captured in one CUDA graph (after an eager warm-up call), kept so that it
    can be timed again later: `time()` is the median over `iters` replays of the per-call time in us.
    Re-timing several variants' graphs in rounds spreads drift (clocks, the other GPU) over all of
    them alike."""

    def __init__(self, fn, reps=20):
        import torch
        fn()
        torch.cuda.synchronize()
        self.fn = fn   # keeps what the graph reads alive (a closure's tensors) as long as the timer
        self.reps = reps
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for _ in range(reps):
                fn()
        self.graph.replay()
        torch.cuda.synchronize()

    def time(self, iters=30, hide_launch: bool = False) -> float:
        """hide_launch: the GPU first spins (torch.cuda._sleep, about 0.5 ms) and the start event is
        recorded after it, so the host's launch of the replay overlaps the spin instead of being timed
        with the calls (as in a model's graph, where one launch serves every layer of a step)."""
        import torch
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if hide_launch:
                torch.cuda._sleep(1_000_000)
            a.record()
            self.graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / self.reps)
        times.sort()
        return times[len(times) // 2]


def with_attrs(modules, fn, values: dict):
    """fn wrapped so that it runs with these attributes set (e.g. the comm module's kernel options or
    an entry of kernels/tuning.py, read when kernels are launched or captured), each on the first of
    `modules` (one module or several) that has it, restored after each call."""
    modules = modules if isinstance(modules, (tuple, list)) else (modules,)
    owner = {k: next(m for m in modules if hasattr(m, k)) for k in values}

    def run():
        keep = {k: getattr(owner[k], k) for k in values}
        for k, v in values.items():
            setattr(owner[k], k, v)
        try:
            return fn()
        finally:
            for k, v in keep.items():
                setattr(owner[k], k, v)
    return run


@contextlib.contextmanager
def env(values: dict):
    """These environment variables set inside the block (read by dispatch when a variant compiles,
    runs and is captured), restored after it."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def time_graph(fn, reps=20, iters=30):
    return GraphTimer(fn, reps).time(iters)


def median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


BW_SEEN: dict[str, float] = {}


def hbm_bandwidth():
    """The memory ceiling for floors and bandwidth shares: the larger of a 1 GiB device copy (bytes
    read + written) and a 2 GiB read-only reduction, both graphed (the two are in BW_SEEN). Decode
    mostly reads, and the copy alone measured 2.71 TB/s on the x2 machine while a cuBLAS GEMM read
    its weights at 3.5 TB/s: a copy-only ceiling made every floor too loose."""
    import torch
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = time_graph(lambda: y.copy_(x), reps=5, iters=10)
    BW_SEEN["copy_read_write"] = 2 * x.numel() / (t * 1e-6)
    r = torch.ones(1 << 29, dtype=torch.float32, device="cuda")
    out = torch.empty((), device="cuda")
    t = time_graph(lambda: torch.sum(r, dim=0, out=out), reps=5, iters=10)
    BW_SEEN["read_only"] = r.numel() * 4 / (t * 1e-6)
    return max(BW_SEEN.values())  # bytes/s



def commit() -> str:
    if os.environ.get("K3_COMMIT"):
        return os.environ["K3_COMMIT"]
    try:
        with open(os.path.join(ROOT, ".k3_commit")) as f:
            return f.read().strip()
    except OSError:
        pass
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def save(path: str | None, result: dict, t0: float | None = None) -> dict:
    """result + command line, date, wall time, commit; written as JSON to `path` when given."""
    out = dict(result, command="python " + os.path.relpath(sys.argv[0], ROOT) + " " + " ".join(sys.argv[1:]),
               date=time.strftime("%Y-%m-%d"), commit=commit())
    if t0 is not None:
        out["wall_s"] = time.time() - t0
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    return out
