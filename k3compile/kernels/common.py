"""What every kernel family uses: the float dtypes the kernels take, their Triton names, and allocation of
tensors kept across calls off the calling thread."""
from __future__ import annotations

import torch
import triton.language as tl

# the dtypes the kernels accept, and the Triton dtype of each (a launch's DTYPE)
FLOAT = (torch.bfloat16, torch.float16, torch.float32)
TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def off_thread(make, device: torch.device):
    """make() on a helper thread, for a tensor kept across calls: during a CUDA-graph-trees warm-up
    (mode="reduce-overhead") every allocation of the calling thread goes to the graph's private
    pool, and a kept tensor there is an untracked live allocation (cudagraph_trees refuses it).
    On CUDA the helper waits for its stream, so the result is ready when this returns."""
    if device.type != "cuda":
        return make()
    import threading
    out: list = []

    def run():
        try:
            with torch.cuda.device(device):
                out.append(make())
                torch.cuda.current_stream(device).synchronize()
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            out.append(e)
    torch.cuda.current_stream(device).synchronize()  # the weights' last writes, if any, are done
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]
