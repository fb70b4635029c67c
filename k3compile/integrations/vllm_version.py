"""Which vLLM the hook is written for, and the errors when vLLM is absent or another version (imports no vLLM)."""
from __future__ import annotations

import re

SUPPORTED_SERIES = ((0, 33),)  # vLLM release series whose pass contract the hook is written to
TESTED_VERSION = "0.33.0"
EXTRA = "pip install 'k3compile[vllm]'"


class UnsupportedVllmVersion(ImportError):
    """The installed vLLM is not a version whose compilation contract the hook implements."""


def check_version(version: str) -> None:
    m = re.match(r"(\d+)\.(\d+)", str(version))
    if m is None or (int(m.group(1)), int(m.group(2))) not in SUPPORTED_SERIES:
        supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_SERIES)
        raise UnsupportedVllmVersion(
            f"k3compile's vLLM hook supports vLLM {supported} (tested with {TESTED_VERSION}); "
            f"found vLLM {version}. Install a supported version: {EXTRA} (vllm=={TESTED_VERSION})",
            name="vllm")


def require_vllm() -> str:
    """Import vLLM and check its version; returns the version."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"k3compile's vLLM hook needs vLLM, an optional dependency of k3compile: {EXTRA} "
                          f"(installs vllm=={TESTED_VERSION})", name="vllm") from e
    version = getattr(vllm, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version
        version = dist_version("vllm")
    check_version(version)
    return version
