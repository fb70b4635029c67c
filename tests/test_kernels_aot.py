"""The Triton kernels compile for sm_90 (Hopper) on this CPU-only machine, and their PTX holds the
instructions the design relies on: system-scope acquire/release CAS in the barrier, and the bulk
L2 prefetch. Runs in a subprocess without TRITON_INTERPRET (the interpreter tests set it)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_kernels_compile_for_sm90_with_expected_ptx():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "k3compile.kernels.aot_check", "--quick"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln]
    assert len(lines) == 6 and all(": ok (" in ln for ln in lines), r.stdout
