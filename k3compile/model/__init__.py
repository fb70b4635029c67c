"""The K3 reference model: plain PyTorch, tensor parallel, MXFP4 experts. Knows nothing of the compiler."""
from .config import K3Config
from .model import K3Cache, K3Model
from .tp import TPInfo

__all__ = ["K3Config", "K3Cache", "K3Model", "TPInfo"]
