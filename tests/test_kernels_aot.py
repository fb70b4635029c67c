"""The Triton kernels compile for sm_90 (Hopper) on this CPU-only machine, and their PTX holds the
instructions the design relies on: the barrier's system-scope release signal and acquire wait (both
protocols), the bulk L2 prefetch, tensor-core MMAs in the dot_scaled expert kernels and no
flush-to-zero in the v2b ones (aot_check's EXPECT / FORBID). Runs in a subprocess without TRITON_INTERPRET (the interpreter tests set it)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_kernels_compile_for_sm90_with_expected_ptx():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "bench.aot_check", "--quick"], env=env, cwd=root,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln]
    sys.path.insert(0, root)
    from bench.aot_check import QUICK, variants
    quick = {n for n, *_ in variants() if n.startswith(QUICK)}
    assert {ln.split(":")[0] for ln in lines} == quick and len(quick) >= 17, r.stdout
    assert all(": ok (" in ln for ln in lines), r.stdout
