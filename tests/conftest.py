import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch and reads only its own match reports."""
    import k3compile
    torch._dynamo.reset()
    k3compile.clear_reports()
    yield
