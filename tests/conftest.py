import os

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run only in Triton's interpreter (tests/test_kernels.py). The
    # switch is read when `triton.jit` decorates a function, Triton's own helpers (tl.zeros, ...)
    # included, so it must be on before anything imports triton: Inductor does when an earlier test
    # module is collected, after which test_kernels.py's own setdefault comes too late.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread per process: the tiny test models gain nothing from more, and the test workers and
# the gloo ranks they start share CI's two cores (11% less wall time, measured on two multi-rank modules).
# Set in the environment too, for the rank processes and subprocesses the tests start.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch and reads only its own match reports."""
    import k3compile
    torch._dynamo.reset()
    k3compile.clear_reports()
    yield
