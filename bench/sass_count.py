"""SASS instruction counts of the Triton kernels compiled for sm_90, on a machine without a GPU.

Compiles each `bench.aot_check` variant whose name starts with one of the given
prefixes (Triton's bundled ptxas), disassembles it with the bundled cuobjdump, and prints the total
instruction count, the most frequent opcodes and the local-memory traffic (LDL/STL: register
spills). Per-thread counts divided by the bytes a thread streams give a cost per byte that can be
compared across variants before any GPU time is spent (for a runtime k loop: the loop body's count
per iteration, printed too, times the iterations, plus the rest):

    python bench/sass_count.py "mxfp4_v2b_gate_up I384" mxfp4_gate_up
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sass(cubin: bytes) -> str:
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def count(text: str) -> collections.Counter:
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", text)
    return collections.Counter(ops)


def loop_body(text: str) -> collections.Counter:
    """Opcodes of the largest loop (a backward branch's range): per-iteration cost of a runtime
    k loop (tl.range), whose static count says nothing about how often it runs. Empty if none."""
    ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?([A-Z0-9_]+)[^;]*;)", text)
    addr = [int(a, 16) for a, _, _ in ins]
    best = collections.Counter()
    for i, (a, full, op) in enumerate(ins):
        m = re.search(r"0x([0-9a-f]+)", full.split("BRA", 1)[1]) if op == "BRA" else None
        if m and int(m.group(1), 16) < int(a, 16) and int(m.group(1), 16) in addr:
            body = collections.Counter(o for _, _, o in ins[addr.index(int(m.group(1), 16)):i + 1])
            if sum(body.values()) > sum(best.values()):
                best = body
    return best


def main(argv=None) -> int:
    from bench import aot_check as A
    prefixes = tuple(argv if argv is not None else sys.argv[1:]) or ("mxfp4",)
    for name, fn, types, consts in A.variants():
        if name.startswith(prefixes):
            text = sass(A.compile_one(fn, types, consts, aligned=name.startswith("mxfp4")).asm["cubin"])
            c, body = count(text), loop_body(text)
            print(f"{name}: {sum(c.values())} instructions, spills LDL {c['LDL']} STL {c['STL']}; "
                  + ", ".join(f"{o} {n}" for o, n in c.most_common(10)))
            if sum(body.values()) > 1:
                print(f"    loop body: {sum(body.values())} instructions; "
                      + ", ".join(f"{o} {n}" for o, n in body.most_common(10)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
