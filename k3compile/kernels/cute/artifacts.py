"""CuTe or the default path, per op and M: which CuTe artifact serves a call, and why one did not.

`wanted(op, m)`: the M range where the CuTe kernel measured faster (`tuning.CUTE_M`);
`K3_KNOBS=cute=1` forces CuTe wherever an artifact fits, `K3_KNOBS=cute=0` turns it off;
`K3_CUTE_DIR` is where `python -m k3compile.kernels.cute.build` put the artifacts.
JIT: where the DSL is installed and no artifact fits a wanted shape that the build has a variant
for (`build.jit_variants`), the first call builds it into that directory (`build.ensure`: the AOT
build's code, cache key and checks) and loads it; `K3_KNOBS=cute_jit=0` turns this off, and it never
runs inside a CUDA graph capture (warm up eagerly first).
When CuTe was chosen but cannot run (no artifact for the shape and no JIT build, not CUDA, wrong
dtype, JIT build or loader error) the op falls back to its default path (Triton v3 for the
experts, cuBLAS for the GEMM), warns once per reason (`note`), and `fallbacks()` lists the reasons.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ...config import knob
from .. import tuning

_WHY: dict[str, str] = {}


def note(key: str, why: str, then: str = "running the default path") -> None:
    """Record why a wanted CuTe kernel did not run; warn the first time for each op/shape."""
    if key not in _WHY:
        _WHY[key] = why
        warnings.warn(f"k3: CuTe kernel not used for {key}: {why}; {then}", stacklevel=3)


def wanted(op: str, m: int) -> bool:
    flag = knob("cute")
    if flag == "0":
        return False
    if flag not in ("", "0"):
        return True
    lo, hi = tuning.CUTE_M.get(op, (1, 0))
    return lo <= m <= hi


def fallbacks() -> dict[str, str]:
    """op/shape -> why a wanted CuTe kernel did not run."""
    return dict(_WHY)


def artifact_dir():
    """The user's artifact directory: `K3_CUTE_DIR`, else ~/.cache/k3compile/cute (the JIT path builds here)."""
    from .build import default_dir
    return default_dir()


def packaged_dir() -> Path:
    """The artifacts shipped in the package (`aot/`: the default variants' cubins and manifests for the
    K3 shapes `build.variants()` lists, built with this source: tests/test_cute.py checks their keys)."""
    return Path(__file__).resolve().parent / "aot"


def search_dirs() -> list[Path]:
    """Where a lookup looks, in order: the user's directory, then the packaged one."""
    user, shipped = Path(artifact_dir()), packaged_dir()
    return [user] + ([shipped] if shipped.is_dir() and shipped.resolve() != user.resolve() else [])


def source(art) -> str:
    """Where an artifact came from, for the report: 'packaged with k3compile' or its directory."""
    return "packaged with k3compile" if Path(art.path).parent.resolve() == packaged_dir() else str(Path(art.path).parent)


_FOUND: dict[tuple, tuple] = {}


def jit_variants(kind: str, key: tuple) -> tuple[list[dict], str]:
    """The build variants the JIT path would compile for this lookup, or ([], why it cannot)."""
    from . import dsl_available
    if knob("cute_jit") == "0":
        return [], "JIT build off (K3_KNOBS=cute_jit=0)"
    if not dsl_available():
        return [], "no JIT build: the CuTe DSL is not installed"
    from . import build
    vs = build.jit_variants(kind, *key)
    return vs, "" if vs else "no JIT build: the CuTe build has no variant for these shapes"


def find(kind: str, *key, jit: bool = True):
    """loader.find / loader.find_mxfp4, memoised per (artifact dir, shapes): an Artifact reads its
    cubin and loads the module on first launch, so a fresh one per call would re-read the files
    and load a new module every call (and cuModuleLoadData inside a CUDA-graph capture).
    Where nothing fits, the JIT path builds the variants (build.ensure) and looks again, unless
    `jit` is False or a CUDA graph is being captured: those misses are not memoised, so a later
    call can still build."""
    from . import loader
    d = artifact_dir()
    dirs = search_dirs()
    k = (kind, *map(str, dirs), *key)
    if k not in _FOUND:
        fn = loader.find if kind == "gemm" else loader.find_mxfp4

        def look():
            whys = []
            for path in dirs:
                got = fn(path, *key)
                if got[0] is not None:
                    return got
                whys.append(got[1])
            return None, "; ".join(whys)
        got = look()
        if got[0] is None:
            vs, why = jit_variants(kind, key)
            if why:
                got = None, f"{got[1]}; {why}"
            elif not jit:
                return got
            elif torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return None, f"{got[1]}; not built just in time inside a CUDA graph capture"
            else:
                from . import build
                try:
                    for v in vs:
                        build.ensure(v, d)
                    got = look()
                except Exception as e:  # noqa: BLE001 - a failed build falls back, with the reason
                    got = None, f"JIT build failed: {type(e).__name__}: {e}"
        _FOUND[k] = got
    return _FOUND[k]
