"""`k3::` fused ops: reference implementations, fake implementations, kernel dispatch."""
from . import fused  # noqa: F401  (registers torch.ops.k3.*)
from .fused import OPS
from ..kernels.dispatch import describe as describe_kernels

__all__ = ["OPS", "describe_kernels"]
