"""Ahead-of-time build of the CuTe DSL kernels for sm_90a, on a machine without a GPU.

    python -m k3compile.kernels.cute.build [--out DIR] [--force] [--only NAME]

For every variant in `variants()` it runs `cute.compile` on fake tensors
(`cute.runtime.make_fake_tensor`, `CUTE_DSL_ARCH=sm_90a`, `--keep-ptx --keep-cubin`) and writes
into DIR (default `$K3_CUTE_DIR` or `~/.cache/k3compile/cute`):
  NAME.cubin   the sm_90a binary the loader hands to cuModuleLoadData
  NAME.ptx     its PTX (CI checks it for wgmma / TMA instructions)
  NAME.json    the manifest: kernel symbol, block, grid rule, dynamic shared memory, the kernel's
               parameter list (size and alignment of each parameter, parsed from the PTX entry,
               and what the loader puts there: a TMA descriptor, a pointer, an int), the TMA
               descriptors' encoding, and the cache key.
A variant whose manifest holds the same key is not rebuilt: the key hashes the kernel's source
file, its inline-PTX helpers (ptx.py), this file, the variant's shapes and tile config, the DSL version and the target arch.

Export route (issue 6 asked to evaluate three):
- `export_to_c` (.o + .h): the object's host launcher calls the CUDA *runtime* through
  `libcuda_dialect_runtime_static.a` shipped in the DSL wheel (cudaLibraryLoadData,
  cudaLaunchKernelEx...), so using it from Python means linking a shared library against the
  DSL's static runtime and a libcudart of the matching major version (the wheel is the cu12
  flavour; the GPU machine's torch is cu13), plus a C shim for the argument structs. Works, but
  drags a toolchain and a CUDA-runtime version into the run time.
- TVM-FFI export (`--enable-tvm-ffi`): needs the `apache-tvm-ffi` package at run time on the GPU
  machine, which cannot install packages.
- cubin + our launcher (chosen): the artifact is the cubin (tens of KB) and a JSON manifest; the
  loader needs only the CUDA driver (`cuda.bindings.driver`, else ctypes on libcuda.so.1) and
  torch. What the DSL's host code did (encode the TMA descriptors, pick grid and shared memory)
  the loader redoes from the manifest; the build checks the manifest against the PTX entry's
  parameter list, so a DSL change in the kernel ABI fails the build instead of the launch.
JIT path: where the DSL is installed, dispatch (`artifacts.find`) builds a missing
artifact on first use: when the loader finds no artifact for a wanted shape and `jit_variants`
names the variants that cover it, `ensure` compiles each into the artifact directory with this
same code (fake tensors, `--gpu-arch sm_90a` whatever GPU the process runs on, the same cache
key and manifest checks) under a per-variant file lock (TP ranks share the directory), and the
loader looks again. `K3_KNOBS=cute_jit=0` turns it off; it never compiles inside a CUDA graph capture. A
stale artifact (another key) is still used as found; only a missing one is built. Tested on CPU
(tests/test_cute.py) and on the H200 (tests/test_gpu_cute.py, with the DSL installed from wheels).
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ARCH = "sm_90a"
HERE = Path(__file__).resolve().parent


def default_dir() -> Path:
    from ...config import env
    return Path(env("K3_CUTE_DIR") or Path.home() / ".cache" / "k3compile" / "cute")


def variants(alt: bool = False) -> list[dict]:
    """Every (kernel, shapes, tile config) the ops launch (alt: and the MXFP4 alternates). o-proj:
    N = 7168 (hidden), K = 1536 (TP=8) / 6144 (TP=2); MT = token tile (M rounded up to 8, 16, 32, 64)."""
    out = []
    for k in (1536, 6144):
        for mt in (8, 16, 32, 64):
            out.append(dict(name=f"skinny_gemm_bf16_n7168_k{k}_mt{mt}", kernel="skinny_gemm", op="oproj_gemm",
                            n=7168, k=k, mt=mt, stages=8, dtype="bf16"))
    # the same GEMM with the push all-reduce epilogue (skinny_gemm.SkinnyGemmPushSm90): one
    # artifact serves every rank and TP size (rank and world are kernel arguments)
    for k in (1536, 6144):
        for mt in (8, 16, 32, 64):
            out.append(dict(name=f"skinny_gemm_push_bf16_n7168_k{k}_mt{mt}", kernel="skinny_gemm", op="oproj_push",
                            n=7168, k=k, mt=mt, stages=8, dtype="bf16", push=True))
    out += mxfp4_variants(alt)
    return out


# MXFP4 routed experts (mxfp4_experts.py): per-rank expert widths I of TP=8 / TP=2, latent L,
# top-k K; gate-up: BI gate + BI up rows per CTA (NV = L/32 threads); down: BL rows per CTA,
# G row groups of NV = I/32 threads (BL <= G * NV: one thread per row in the reduction); 8 rows
# per thread everywhere but TP=8 gate-up (16): ptxas caps these kernels at 64 registers (16 rows
# per thread in down spilled one register)
MXFP4_SHAPES = dict(L=3584, K=16, tiles={384: dict(bi=8, bl=64, groups=8), 1536: dict(bi=8, bl=32, groups=4)})


# math: "f32" (fp32 FMAs, exact products) or "f16x2" (packed fp16 FMAs per 32-code block with a
# per-thread power-of-two activation scale; ~20% fewer instructions; see mxfp4_experts.py), and the
# dtype of mid (gate-up's output, down's input): f16x2 keeps it in bf16 (down's activation bytes
# halved: 4-15% faster at every measured batch), f32 math in fp32 (its point is accuracy)
MXFP4_MATH = {"f32": ("", "f32"), "f16x2": ("_h2", "bf16")}
# variants of the f16x2 kernels, by tag (moe.mxfp4_tag picks one by shape and batch; benchmarks
# force one with env K3_KNOBS=cute_mxfp4_tag=tag; "alt" ones are built only with --alt). "xf" (built by
# default: dispatch takes it at <= tuning.CUTE_XF_MAX_N tokens where "ldgd" has no range) is a
# gate-up that issues its activation loads before the first cp.async wait (1-10% faster at 1-2
# tokens, slower at 8-16) and pairs with the default down; "m32" keeps mid in fp32, the
# default before bf16 mid measured faster
MXFP4_TAGS = {"xf": dict(x_first=True, modes=("gate_up",), alt=False),
              # both kernels load their weight vectors into registers, one stage of 4 rows ahead of
              # the math (mxfp4_experts wload="ldg"), with xf's activation order; gate-up 16 gate + 16
              # up rows per CTA (32 rows per thread, stages of 4), down its default tile. Built by
              # default: tuning.CUTE_MXFP4_LDG's batches. Tried and dropped (measured):
              # 8 + 8 gate-up rows (2-9% slower at TP=2, 1-3% at TP=8), 4 + 4 (slower), down tiles of
              # 32 x 8, 64 x 16 and 128 x 16 rows x groups (slower but 128 x 16 at TP=8 M=1), stages of
              # 8 gate-up rows (slower).
              "ldgd": dict(wload="ldg", x_first=True, modes=("gate_up", "down"), gu=dict(rows=16, stages=8),
                           dn=dict(stages=2), alt=False),
              # ldgd's gate-up with the default down (what each kernel contributes)
              "ldg": dict(wload="ldg", x_first=True, modes=("gate_up",), gu=dict(rows=16, stages=8), alt=True),
              "m32": dict(mid="f32", modes=("gate_up", "down"), alt=True),
              # 16 rows per thread in down (BL = 2x the default; TP=2 only: at TP=8 down's 96 threads
              # cannot reduce 128 rows): within run-to-run noise of the default. Kept as
              # the regression case of the PDL hazard ptx.ld_v4_dep avoids (with .nc loads ptxas
              # hoisted its mid reads above griddepcontrol.wait). (32 gate-up rows per thread,
              # BI=16, measured 7-15% slower at every batch, and was removed.)
              "dn2x": dict(bl2x=True, modes=("down",), alt=True),
              # the shift dequantisation (3.75 integer ops per code pair), the default until the
              # byte-permute one (2.75, mxfp4_experts.PB_PAIRS) measured faster
              "sh": dict(deq="shift", modes=("gate_up", "down"), alt=True),
              # probes (wrong results; loader.find_mxfp4 serves them only with K3_KNOBS=cute_probe=1, for
              # bench/experts_probe.py): xf's gate-up without the math (what its loads cost) and
              # without the weight loads (what its math costs); ldgnm / ldgnl the same of ldgd
              "nomath": dict(probe="nomath", x_first=True, modes=("gate_up",), alt=True),
              "noload": dict(probe="noload", x_first=True, modes=("gate_up",), alt=True),
              "ldgnm": dict(probe="nomath", wload="ldg", x_first=True, modes=("gate_up", "down"),
                            gu=dict(rows=16, stages=8), dn=dict(stages=2), alt=True),
              "ldgnl": dict(probe="noload", wload="ldg", x_first=True, modes=("gate_up", "down"),
                            gu=dict(rows=16, stages=8), dn=dict(stages=2), alt=True)}
MXFP4_DEQ = {"f32": "shift", "f16x2": "prmt"}      # each math's default dequantisation


def mxfp4_variants(alt: bool = False) -> list[dict]:
    out = []
    L, K = MXFP4_SHAPES["L"], MXFP4_SHAPES["K"]
    opts = [(math, "", dict(modes=("gate_up", "down"))) for math in MXFP4_MATH]
    opts += [("f16x2", tag, o) for tag, o in MXFP4_TAGS.items() if alt or not o["alt"]]
    for math, tag, o in opts:
        sfx, mid = MXFP4_MATH[math]
        sfx += f"_{tag}" if tag else ""
        for I, t in MXFP4_SHAPES["tiles"].items():
            t = dict(t, bl=t["bl"] * (2 if o.get("bl2x") else 1))
            common = dict(kernel="mxfp4_experts", I=I, L=L, K=K, stages=o.get("stages", 4), math=math, tag=tag,
                          mid=o.get("mid", mid), deq=o.get("deq", MXFP4_DEQ[math]))
            common.update({k: o[k] for k in ("wload", "probe") if k in o})
            # "gu" / "dn": a tag's own options for one kernel (rows: BI / BL, groups, stages)
            gu, dn = o.get("gu", {}), o.get("dn", {})
            bi, bl, g = gu.get("rows", t["bi"]), dn.get("rows", t["bl"]), dn.get("groups", t["groups"])
            if "gate_up" in o["modes"]:
                out.append(dict(common, name=f"mxfp4_gate_up_i{I}_l{L}_k{K}_bi{bi}{sfx}", op="mxfp4_gate_up",
                                mode="gate_up", rows=bi, groups=1, x_first=o.get("x_first", False),
                                **{k: v for k, v in gu.items() if k != "rows"}))
            if "down" in o["modes"] and bl <= g * I // 32:    # a thread per row to reduce
                out.append(dict(common, name=f"mxfp4_down_i{I}_l{L}_bl{bl}_g{g}{sfx}", op="mxfp4_down",
                                mode="down", x_first=False, **dict(dn, rows=bl, groups=g)))
    return out


def dsl_version() -> str:
    from importlib.metadata import version
    return version("nvidia-cutlass-dsl")


def cache_key(v: dict, dsl: str | None = None) -> str:
    """The variant's build key; `dsl`: the DSL version it was built with (default: the installed one)."""
    h = hashlib.sha256()
    for f in (HERE / f"{v['kernel']}.py", HERE / "ptx.py", HERE / "build.py"):
        h.update(f.read_bytes())
    h.update(json.dumps(v, sort_keys=True).encode())
    h.update((dsl or dsl_version()).encode())
    h.update(ARCH.encode())
    return h.hexdigest()[:32]


_PARAM = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.(b8|u32|u64|s32|f32|b32|b64)\s+(\w+?)(?:\[(\d+)\])?\s*[,)]")


def ptx_entry_params(ptx: str) -> tuple[str, list[dict]]:
    """(entry symbol, [{size, align}]) of the single .entry in `ptx`."""
    m = re.search(r"\.visible\s+\.entry\s+(\w+)\s*\((.*?)\)", ptx, re.S)
    if not m:
        raise ValueError("no .entry in PTX")
    params = []
    for align, ty, _name, count in _PARAM.findall(m.group(2) + ")"):
        width = {"b8": 1, "u32": 4, "s32": 4, "f32": 4, "b32": 4, "u64": 8, "b64": 8}[ty]
        size = width * int(count or 1)
        params.append(dict(size=size, align=int(align or width)))
    return m.group(1), params


# what the loader puts in each parameter of the skinny GEMMs, in the order of the kernel's signature
_GEMM_PARAMS = [dict(kind="ptr", tensor="out"), dict(kind="i32", name="m_valid")]
_PUSH_PARAMS = [dict(kind="ptr", tensor="ptrs"), dict(kind="ptr", tensor="epoch"), dict(kind="i32", name="m_valid"),
                dict(kind="i32", name="rank"), dict(kind="i32", name="world"), dict(kind="i64", name="half_elems"),
                dict(kind="i64", name="flag_off")]
_SIZE = dict(tma=128, ptr=8, i32=4, i64=8, f32=4)


def _skinny_gemm_manifest(v: dict, symbol: str, params: list[dict]) -> dict:
    n, k, mt, st = v["n"], v["k"], v["mt"], v["stages"]
    kinds = [dict(kind="tma", tensor="w", box=[64, 64]), dict(kind="tma", tensor="x", box=[64, mt])]
    kinds += _PUSH_PARAMS if v.get("push") else _GEMM_PARAMS
    want = [_SIZE[kd["kind"]] for kd in kinds]
    if len(params) < len(kinds) or [p["size"] for p in params[:len(kinds)]] != want:
        raise ValueError(f"{v['name']}: kernel parameters {params} do not match the launcher's "
                         f"{[kd['kind'] for kd in kinds]} ({want} bytes): the DSL changed the kernel ABI")
    for p in params[len(kinds):]:   # empty structs (tiled MMA, layouts): one pad byte each
        if p["size"] != 1:
            raise ValueError(f"{v['name']}: unexpected trailing kernel parameter {p}")
        kinds.append(dict(kind="pad"))
    # dynamic smem: 2 x stages mbarriers (padded to the 1024-byte aligned sA), sA, sB, +1 KiB for
    # the allocator aligning the dynamic-smem base to 1024
    smem = 1024 + st * 64 * 64 * 2 + st * mt * 64 * 2 + 1024
    if v.get("push"):
        smem += mt * 64 * 2   # the bf16 output tile the push epilogue stages
    return dict(symbol=symbol, block=[128, 1, 1], grid=["n/64", 1, 1], smem=smem,
                params=[dict(p, **kd) for p, kd in zip(params, kinds)],
                # TMA descriptors: 2-D, bf16, K innermost, 128-byte swizzle (the smem layout
                # S<3,4,3> the kernel's make_smem_layout_a/b picks), zero fill out of bounds
                tma=dict(dtype="bf16", swizzle=128, interleave="none", l2_promotion=256, oob_fill="zero"),
                shapes=dict(n=n, k=k, mt=mt), m_max=mt)


_MXFP4_PARAMS = [dict(kind="ptr", tensor="x"), dict(kind="ptr", tensor="ids"), dict(kind="ptr", tensor="w"),
                 dict(kind="ptr", tensor="s"), dict(kind="ptr", tensor="out"), dict(kind="f32", name="beta"),
                 dict(kind="f32", name="linear_beta")]


def _mxfp4_manifest(v: dict, k, symbol: str, params: list[dict]) -> dict:
    """Manifest of an MXFP4 expert GEMV variant; `k` is its Mxfp4ExpertGemvSm90 instance."""
    if [(p["size"]) for p in params] != [8, 8, 8, 8, 8, 4, 4]:
        raise ValueError(f"{v['name']}: kernel parameters {params} do not match the launcher's "
                         f"[ptr x5, f32 x2]: the DSL changed the kernel ABI")
    return dict(symbol=symbol, block=[k.threads, 1, 1], grid=["P", k.row_blocks, 1], smem=k.smem_bytes,
                params=[dict(p, **kd) for p, kd in zip(params, _MXFP4_PARAMS)],
                shapes=dict(I=v["I"], L=v["L"], K=v["K"], rows=v["rows"], groups=v["groups"], nv=k.nv, q=k.q),
                math=v["math"], mid=v.get("mid", "f32"), tag=v.get("tag", ""), probe=v.get("probe", ""),
                # Programmatic Dependent Launch: gate-up triggers its dependents, down waits for its
                # predecessor after issuing its weight loads and is launched with the PDL attribute
                pdl="trigger" if v["mode"] == "gate_up" else "wait",
                # what the loader checks before launching: base alignment (bytes) of each tensor
                align=dict(x=16, w=16, s=4, out=4, ids=4))


def _compile_mxfp4(v: dict, out: Path) -> dict:
    import cutlass
    from .mxfp4_experts import Mxfp4ExpertGemvSm90

    k = Mxfp4ExpertGemvSm90(v["mode"], v["I"], v["L"], v["K"], v["rows"], v["groups"], v["stages"], v["math"],
                            v.get("mid", "f32"), v.get("x_first", False), v.get("deq", "shift"), v.get("wload", "cp"),
                            v.get("probe", ""))
    z = cutlass.Int64(0)
    return _compile(v, out, k, (z, z, z, z, z, cutlass.Int32(1), cutlass.Float32(4.0), cutlass.Float32(25.0)),
                    lambda symbol, params: _mxfp4_manifest(v, k, symbol, params))


def _compile(v: dict, out: Path, kernel, args: tuple, manifest) -> dict:
    """cute.compile(kernel, *args, stream) for sm_90a, its PTX entry checked, then cubin + PTX +
    manifest (manifest(symbol, params)) written to `out`."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        fn = cute.compile(kernel, *args, cuda.CUstream(0),
                          options=f"--gpu-arch {ARCH} --keep-ptx --keep-cubin --dump-dir {tmp}")
        dt = time.time() - t0
        ptx, cubin = fn.__ptx__, fn.__cubin__
    if not isinstance(ptx, str) or not isinstance(cubin, bytes) or not ptx.strip():
        raise RuntimeError(f"{v['name']}: the DSL returned no PTX / cubin ({type(ptx)}, {type(cubin)})")
    man = manifest(*ptx_entry_params(ptx))
    man.update(variant=v, key=cache_key(v), dsl=dsl_version(), arch=ARCH, compile_s=round(dt, 3))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{v['name']}.cubin").write_bytes(cubin)
    (out / f"{v['name']}.ptx").write_text(ptx)
    (out / f"{v['name']}.json").write_text(json.dumps(man, indent=1))
    return man


def compile_variant(v: dict, out: Path) -> dict:
    os.environ.setdefault("CUTE_DSL_ARCH", ARCH)
    if v["kernel"] == "mxfp4_experts":
        return _compile_mxfp4(v, out)
    import cutlass
    from cutlass.cute.runtime import make_fake_tensor
    from .skinny_gemm import SkinnyGemmPushSm90, SkinnyGemmSm90

    n, k, mt = v["n"], v["k"], v["mt"]
    w = make_fake_tensor(cutlass.BFloat16, (n, k), (k, 1), assumed_align=16)
    x = make_fake_tensor(cutlass.BFloat16, (mt, k), (k, 1), assumed_align=16)
    if v.get("push"):
        from .loader import push_n_fits
        if not push_n_fits(n):
            raise ValueError(f"{v['name']}: the push epilogue needs N a multiple of 64 and N / 64 <= 128 tiles")
        z, i = cutlass.Int64(0), cutlass.Int32(1)
        return _compile(v, out, SkinnyGemmPushSm90(mt, v["stages"]), (w, x, z, z, cutlass.Int32(mt), i, i, z, z),
                        lambda symbol, params: _skinny_gemm_manifest(v, symbol, params))
    o = make_fake_tensor(cutlass.BFloat16, (n, mt), (1, n), assumed_align=16)
    return _compile(v, out, SkinnyGemmSm90(mt, v["stages"]), (w, x, o, cutlass.Int32(mt)),
                    lambda symbol, params: _skinny_gemm_manifest(v, symbol, params))


def cached(v: dict, out: Path) -> dict | None:
    """The manifest of `v` in `out` if it and its cubin are there with the current cache key."""
    mf = out / f"{v['name']}.json"
    if not (mf.exists() and (out / f"{v['name']}.cubin").exists()):
        return None
    try:
        old = json.loads(mf.read_text())
    except ValueError:   # half-written by another process: not there yet
        return None
    return old if old.get("key") == cache_key(v) else None


def build(out: Path | None = None, force: bool = False, only: str | None = None, log=print,
          alt: bool = False) -> dict[str, dict]:
    out = Path(out) if out else default_dir()
    done = {}
    for v in variants(alt):
        if only and only not in v["name"]:
            continue
        old = None if force else cached(v, out)
        if old is not None:
            log(f"{v['name']}: cached")
            done[v["name"]] = old
            continue
        man = compile_variant(v, out)
        size = (out / f"{v['name']}.cubin").stat().st_size
        log(f"{v['name']}: built in {man['compile_s']} s, cubin {size} bytes, smem {man['smem']}")
        done[v["name"]] = man
    return done


def jit_variants(kind: str, *key) -> list[dict]:
    """The variants dispatch needs for one lookup (`artifacts.find`'s kind and key), [] where
    `variants()` has none: "gemm" (op, n, k, m): the smallest token tile covering m;
    "mxfp4" (I, L, K, math[, tag]): the gate-up (top-k K compiled in) and the down GEMV."""
    if kind == "gemm":
        op, n, k, m = key
        fit = [v for v in variants()
               if v["kernel"] == "skinny_gemm" and v["op"] == op and v["n"] == n and v["k"] == k and m <= v["mt"]]
        return sorted(fit, key=lambda v: v["mt"])[:1]
    I, L, K, math = key[:4]
    tag = key[4] if len(key) > 4 else ""
    fit = [v for v in mxfp4_variants(alt=bool(tag))
           if v["I"] == I and v["L"] == L and v["math"] == math and (v["mode"] == "down" or v["K"] == K)]
    if tag and not any(v["tag"] == tag for v in fit):
        return []
    # a tag that changes one kernel pairs it with the other's untagged one
    gu, dn = ([v for v in fit if v["mode"] == m and v["tag"] == tag] or
              [v for v in fit if v["mode"] == m and v["tag"] == ""] for m in ("gate_up", "down"))
    return gu + dn if len(gu) == 1 and len(dn) == 1 else []


def ensure(v: dict | str, out: Path | None = None) -> Path:
    """The JIT build: compile one variant (a `variants()` dict or its name) into `out` unless it
    is there with the current cache key (`cached`); returns its manifest's path. A lock file per
    variant makes concurrent processes (TP ranks sharing `out`) wait for one compile."""
    if isinstance(v, str):
        name, v = v, next((x for x in variants(alt=True) if x["name"] == v), None)
        if v is None:
            raise KeyError(f"no CuTe build variant named {name!r}")
    out = Path(out) if out else default_dir()
    if cached(v, out) is None:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"{v['name']}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if cached(v, out) is None:   # another process may have built it while we waited
                compile_variant(v, out)
    return out / f"{v['name']}.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--only", default=None)
    ap.add_argument("--alt", action="store_true", help="also the MXFP4 alternates (MXFP4_TAGS' alt ones)")
    a = ap.parse_args(argv)
    build(a.out, a.force, a.only, alt=a.alt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
