"""k3compile: a torch.compile backend for the Kimi K3 decoder.

    import torch
    model.compile(backend="k3")                      # no import of k3compile needed; in place, so the
                                                     # model's decode() / prefill() (they call model(...)) run compiled
    import k3compile; k3compile.backend(strict=True)  # a configured backend
"""
from . import config as _config

from .report import clear_reports, last_report, reports

if _config.knob("mla_triton", "1") != "0":   # the model's MLA decode on Triton (kernels/model_ops.py)
    from .kernels import model_ops as _model_ops  # noqa: F401

__version__ = "0.1.0"


def backend(**options):
    from .compiler import backend as _b
    return _b(**options)


__all__ = ["backend", "last_report", "reports", "clear_reports", "__version__"]
