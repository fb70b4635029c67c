"""k3compile: a torch.compile backend for the Kimi K3 decoder.

    import torch
    model = torch.compile(model, backend="k3")       # no import of k3compile needed
    import k3compile; k3compile.backend(strict=True)  # a configured backend
"""
from .report import clear_reports, last_report, reports

__version__ = "0.1.0"


def backend(**options):
    from .compiler import backend as _b
    return _b(**options)


__all__ = ["backend", "last_report", "reports", "clear_reports", "__version__"]
