"""README.md's Python API example runs as written and fuses.

The first ```python block after the line starting "Python API" is extracted and run in a fresh
interpreter with K3_MODE=eager (the k3 backend's op-by-op mode: the same passes and report, without
Inductor's CPU codegen, which takes most of a minute on 2 cores). It must exit 0 and print a match
report with every enabled pass's sites matched.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
MARKER = "Python API"


def readme_example() -> str:
    text = README.read_text()
    start = next((m.end() for m in re.finditer(rf"^{MARKER}.*$", text, re.M)), None)
    assert start is not None, f"README.md has no line starting {MARKER!r}"
    block = re.search(r"^```python\n(.*?)^```$", text[start:], re.M | re.S)
    assert block, f"no ```python block after {MARKER!r} in README.md"
    return block.group(1)


def test_readme_example_runs_and_fuses(tmp_path):
    code = readme_example()
    assert "import k3compile" in code and "last_report()" in code
    script = tmp_path / "readme_example.py"
    script.write_text(code)
    env = {**os.environ, "K3_MODE": "eager"}
    for k in ("K3_PASSES", "K3_SKIP", "K3_STRICT", "K3_GATE"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert re.search(r"^k3: graph\d+: 8 attention layers, 7 MoE layers, TP=1, M=2, dtype=bfloat16$", out, re.M), out
    sites = re.findall(r"^  (\w+) +(\d+)/(\d+) sites", out, re.M)
    assert len(sites) >= 10, out
    for name, k, n in sites:
        assert int(k) == int(n) > 0, (name, k, n, out)
    assert "not supported" not in out and "graph: the fused ops accept" not in out, out
