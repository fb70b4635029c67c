"""Load and launch the AOT-built CuTe kernels without the DSL: cubin + JSON manifest (`build.py`).

The CUDA driver is reached through ctypes on libcuda.so.1 (cuModuleLoadData, cuModuleGetFunction,
cuFuncSetAttribute, cuTensorMapEncodeTiled, cuLaunchKernel): the driver library is on every GPU
machine, so launching needs nothing installed beyond torch (the GPU machine cannot install
cuda-bindings or the DSL). Kernels launch on torch's current stream, so they are captured by
CUDA graphs like any other kernel.

What the DSL's host code did at launch, this module redoes from the manifest: encode the two TMA
descriptors (2-D, bf16, K innermost, 128-byte swizzle; the row count is the real M so rows past
M are zero-filled), pack the kernel parameters in the order and sizes of the PTX entry
(`pack_params`, unit-tested on CPU with a fake encoder), size the grid and dynamic shared memory.
Importing this module touches no GPU and no CUDA library.
"""
from __future__ import annotations

import ctypes
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from ...config import knob

# CUtensorMap enums (cuda.h)
TMA_DTYPE = {"bf16": 9, "fp16": 6, "fp32": 7, "u8": 0}           # CU_TENSOR_MAP_DATA_TYPE_*
TMA_SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}                         # CU_TENSOR_MAP_SWIZZLE_*
TMA_L2 = {0: 0, 64: 1, 128: 2, 256: 3}                             # CU_TENSOR_MAP_L2_PROMOTION_*
TMA_OOB = {"zero": 0, "nan": 1}
ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "u8": 1}
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6   # CUlaunchAttributeID


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the id, 4 bytes of padding, a 64-byte value union (cuda.h)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h), for cuLaunchKernelEx."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("sharedMemBytes", ctypes.c_uint),
                ("hStream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def pdl_config(grid, block, smem: int, stream: int) -> tuple[LaunchConfig, LaunchAttribute]:
    """A launch config with programmatic stream serialisation allowed (Programmatic Dependent
    Launch): the kernel may start before the previous one in the stream has finished, and waits for
    it where it executes griddepcontrol.wait. Returns the attribute too: it must outlive the launch."""
    attr = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value = struct.pack("<i", 1).ljust(64, b"\0")   # programmaticStreamSerializationAllowed = 1
    cfg = LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), smem, ctypes.c_void_p(stream),
                       ctypes.pointer(attr), 1)
    return cfg, attr


@dataclass(frozen=True)
class TmaSpec:
    """Arguments of one cuTensorMapEncodeTiled call (dims innermost first, strides in bytes)."""
    dtype: int
    addr: int
    dims: tuple[int, int]
    strides: tuple[int]
    box: tuple[int, int]
    swizzle: int
    l2: int
    oob: int


def tma_spec(man: dict, p: dict, addr: int, rows: int, cols: int) -> TmaSpec:
    t = man["tma"]
    eb = ELEM_BYTES[t["dtype"]]
    if addr % 16 or (cols * eb) % 16:
        raise ValueError(f"TMA needs 16-byte aligned base and row pitch (addr {addr:#x}, {cols} x {eb} B)")
    return TmaSpec(TMA_DTYPE[t["dtype"]], addr, (cols, rows), (cols * eb,), tuple(p["box"]),
                   TMA_SWIZZLE[t["swizzle"]], TMA_L2[t["l2_promotion"]], TMA_OOB[t["oob_fill"]])


def pack_params(man: dict, *, w: tuple[int, int, int], x: tuple[int, int, int], encode_tma, out: int = 0,
                m_valid: int = 0, values: dict | None = None) -> list[bytes]:
    """Kernel parameter values in signature order, each exactly the size the PTX entry declares.
    w, x = (device address, rows, cols) of the row-major bf16 weight [N, K] and tokens [M, K];
    out = address of the row-major output [M, N]; `values`: the other parameters by the manifest's
    "tensor" / "name" (the push GEMM's ptrs, epoch, rank, ...); encode_tma(TmaSpec) -> 128 bytes."""
    tensors = {"w": w, "x": x}
    named = dict(out=out, m_valid=m_valid, **(values or {}))
    vals = []
    for p in man["params"]:
        kind = p["kind"]
        if kind == "tma":
            blob = _sized(p, encode_tma(tma_spec(man, p, *tensors[p["tensor"]])))
        else:
            blob = _scalar(p, _value(p, named))
        vals.append(blob)
    return vals


def _sized(p: dict, blob: bytes) -> bytes:
    if len(blob) != p["size"]:
        raise ValueError(f"parameter {p['kind']} packs to {len(blob)} bytes, the kernel expects {p['size']}")
    return blob


def _scalar(p: dict, value) -> bytes:
    """One ptr / i32 / f32 / pad parameter as the bytes the kernel declares."""
    kind = p["kind"]
    if kind == "ptr":
        return _sized(p, struct.pack("<Q", int(value)))
    if kind == "i32":
        return _sized(p, struct.pack("<i", int(value)))
    if kind == "i64":
        return _sized(p, struct.pack("<q", int(value)))
    if kind == "f32":
        return _sized(p, struct.pack("<f", float(value)))
    if kind == "pad":
        return b"\0" * p["size"]
    raise ValueError(f"unknown parameter kind {kind!r}")


def _value(p: dict, values: dict):
    """A non-TMA parameter's value: its ptr's "tensor" or its scalar's "name" looked up in `values`."""
    return values[p["tensor"]] if p["kind"] == "ptr" else values.get(p.get("name"))


def pack_values(man: dict, values: dict) -> list[bytes]:
    """Parameters of a kernel whose manifest names them (kinds ptr / i32 / f32 / pad): `values`
    maps each ptr's "tensor" and each scalar's "name" to a device address / number."""
    return [_scalar(p, _value(p, values)) for p in man["params"]]


# the push epilogue's flags: one int32 per (source rank, 64-column tile), at most this many tiles
# per rank (skinny_gemm.SkinnyGemmPushSm90, triton_comm._wait_pushed)
PUSH_MAX_TILES = 128


def push_n_fits(n: int) -> bool:
    """Whether an output width N suits the push epilogue: whole 64-column tiles, at most
    PUSH_MAX_TILES of them."""
    return n % 64 == 0 and n // 64 <= PUSH_MAX_TILES


def grid_of(man: dict, **dims: int) -> tuple[int, int, int]:
    """The manifest's grid with symbolic entries ("P", "n/64") resolved from `dims`."""
    g = []
    for d in man["grid"]:
        if d == "n/64":
            g.append((dims["n"] + 63) // 64)
        elif isinstance(d, str):
            g.append(int(dims[d]))
        else:
            g.append(int(d))
    return g[0], g[1], g[2]


class _Params:
    """ctypes storage for cuLaunchKernel's void** kernelParams; each value 64-byte aligned and
    kept alive by this object."""

    def __init__(self, blobs: list[bytes]):
        self._bufs = []
        self.array = (ctypes.c_void_p * len(blobs))()
        for i, b in enumerate(blobs):
            raw = ctypes.create_string_buffer(len(b) + 64)
            addr = (ctypes.addressof(raw) + 63) & ~63
            ctypes.memmove(addr, b, len(b))
            self._bufs.append(raw)
            self.array[i] = addr


class Driver:
    """The few driver entry points we need, through ctypes."""

    def __init__(self, lib: str = "libcuda.so.1"):
        self.cu = ctypes.CDLL(lib)
        for name in ("cuModuleLoadData", "cuModuleGetFunction", "cuFuncSetAttribute", "cuLaunchKernel",
                     "cuTensorMapEncodeTiled", "cuGetErrorString", "cuCtxGetCurrent"):
            getattr(self.cu, name).restype = ctypes.c_int
        self.has_launch_ex = hasattr(self.cu, "cuLaunchKernelEx")   # CUDA >= 12.0
        if self.has_launch_ex:
            self.cu.cuLaunchKernelEx.restype = ctypes.c_int

    def check(self, rc: int, what: str) -> None:
        if rc:
            s = ctypes.c_char_p()
            self.cu.cuGetErrorString(rc, ctypes.byref(s))
            raise RuntimeError(f"{what}: CUDA error {rc} ({(s.value or b'?').decode()})")

    def load(self, cubin: bytes, symbol: str, smem: int):
        ctx = ctypes.c_void_p()
        self.check(self.cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            raise RuntimeError("no current CUDA context (initialise torch.cuda on this device first)")
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._keep = getattr(self, "_keep", []) + [cubin]
        self.check(self.cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(cubin)), "cuModuleLoadData")
        self.check(self.cu.cuModuleGetFunction(ctypes.byref(fn), mod, symbol.encode()), "cuModuleGetFunction")
        self.check(self.cu.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                   "cuFuncSetAttribute(max dynamic smem)")
        return fn

    def encode_tma(self, s: TmaSpec) -> bytes:
        m = (ctypes.c_uint8 * 192)()
        base = (ctypes.addressof(m) + 63) & ~63
        u64 = ctypes.c_uint64 * 2
        u32 = ctypes.c_uint32 * 2
        self.check(self.cu.cuTensorMapEncodeTiled(
            ctypes.c_void_p(base), ctypes.c_int(s.dtype), ctypes.c_uint32(2), ctypes.c_void_p(s.addr),
            u64(*s.dims), (ctypes.c_uint64 * 1)(*s.strides), u32(*s.box), u32(1, 1),
            ctypes.c_int(0), ctypes.c_int(s.swizzle), ctypes.c_int(s.l2), ctypes.c_int(s.oob)),
            f"cuTensorMapEncodeTiled({s})")
        return ctypes.string_at(base, 128)

    def launch(self, fn, grid, block, smem: int, stream: int, params: _Params, pdl: bool = False) -> None:
        """pdl: launch with Programmatic Dependent Launch (cuLaunchKernelEx), for kernels that
        execute griddepcontrol.wait before they read what the previous kernel wrote."""
        if pdl and self.has_launch_ex:
            cfg, attr = pdl_config(grid, block, smem, stream)
            self.check(self.cu.cuLaunchKernelEx(ctypes.byref(cfg), fn, params.array, None), "cuLaunchKernelEx(PDL)")
            return
        self.check(self.cu.cuLaunchKernel(fn, *grid, *block, ctypes.c_uint(smem), ctypes.c_void_p(stream),
                                          params.array, None), "cuLaunchKernel")


def grid(man: dict, n: int) -> tuple[int, int, int]:
    """The GEMM manifests' grid for N output rows (grid_of with n)."""
    return grid_of(man, n=n)


def device_index(device) -> int:
    """The CUDA device index of `device` (torch's current device when it names none)."""
    import torch
    return device.index if device.index is not None else torch.cuda.current_device()


class Artifact:
    """One AOT-built variant: manifest + cubin, loaded lazily per device."""

    def __init__(self, manifest_path: Path):
        self.path = Path(manifest_path)
        self.man = json.loads(self.path.read_text())
        self.cubin = self.path.with_suffix(".cubin").read_bytes()
        self._fn: dict[int, object] = {}

    def launch_gemm(self, x, w, out=None, driver: Driver | None = None):
        """out[M, N] = x[M, K] @ w[N, K]^T on torch's current stream (bf16, contiguous, M <= m_max)."""
        import torch
        M, N, K = self._check_gemm(x, w, push=False)
        drv = driver or _driver()
        if out is None:
            out = torch.empty(M, N, device=x.device, dtype=x.dtype)
        dev = device_index(x.device)
        blobs = pack_params(self.man, w=(w.data_ptr(), N, K), x=(x.data_ptr(), M, K), out=out.data_ptr(),
                            m_valid=M, encode_tma=drv.encode_tma)
        drv.launch(self._function(dev, drv), grid_of(self.man, n=N), tuple(self.man["block"]), self.man["smem"],
                   torch.cuda.current_stream(x.device).cuda_stream, _Params(blobs))
        return out

    def _check_gemm(self, x, w, push: bool) -> tuple[int, int, int]:
        """(M, N, K) of a call this skinny-GEMM artifact can take (bf16, contiguous, its N and K,
        M <= m_max, the plain or the push kernel as asked), else ValueError."""
        import torch
        if bool(self.man.get("variant", {}).get("push")) != push:
            raise ValueError(f"artifact {self.path.stem} is {'not ' if push else ''}a push GEMM: launch it with "
                             f"{'launch_gemm' if push else 'launch_push'}")
        M, K = x.shape
        N = w.shape[0]
        sh = self.man["shapes"]
        if (N, K) != (sh["n"], sh["k"]) or M > self.man["m_max"] or x.dtype != torch.bfloat16 or w.dtype != x.dtype:
            raise ValueError(f"artifact {self.path.stem} is for N={sh['n']} K={sh['k']} M<={self.man['m_max']} bf16; "
                             f"got N={N} K={K} M={M} {x.dtype}")
        if not (x.is_contiguous() and w.is_contiguous()):
            raise ValueError("x and w must be contiguous")
        return M, N, K

    def launch_push(self, x, w, peers, flag_off: int, driver: Driver | None = None) -> None:
        """The push o-proj GEMM (skinny_gemm.SkinnyGemmPushSm90): this rank's x @ w^T into every
        rank's symmetric buffer (slot `peers.rank` of the half epoch[0] selects) and its per-tile
        flags at byte offset `flag_off`, on torch's current stream. `peers` is a comm.Peers."""
        import torch
        M, N, K = self._check_gemm(x, w, push=True)
        drv = driver or _driver()
        dev = device_index(x.device)
        vals = dict(ptrs=peers.ptrs.data_ptr(), epoch=peers.epoch.data_ptr(), rank=peers.rank, world=peers.world,
                    half_elems=peers.half(x.dtype), flag_off=flag_off)
        blobs = pack_params(self.man, w=(w.data_ptr(), N, K), x=(x.data_ptr(), M, K), m_valid=M, values=vals,
                            encode_tma=drv.encode_tma)
        drv.launch(self._function(dev, drv), grid_of(self.man, n=N), tuple(self.man["block"]), self.man["smem"],
                   torch.cuda.current_stream(x.device).cuda_stream, _Params(blobs))

    def _function(self, dev: int, drv: Driver):
        import torch
        if dev not in self._fn:
            with torch.cuda.device(dev):
                self._fn[dev] = drv.load(self.cubin, self.man["symbol"], self.man["smem"])
        return self._fn[dev]

    def launch_values(self, values: dict, grid_dims: dict, device, driver: Driver | None = None,
                      pdl: bool = False) -> None:
        """Launch with named parameter values (pack_values) on torch's current stream of `device`;
        pdl: with Programmatic Dependent Launch if the kernel waits for its predecessor (manifest
        "pdl": "wait"; otherwise the flag is ignored)."""
        import torch
        drv = driver or _driver()
        dev = device_index(device)
        params = _Params(pack_values(self.man, values))
        drv.launch(self._function(dev, drv), grid_of(self.man, **grid_dims), tuple(self.man["block"]),
                   self.man["smem"], torch.cuda.current_stream(device).cuda_stream, params,
                   pdl=pdl and self.man.get("pdl") == "wait")


def mxfp4_check(man: dict, tensors: dict) -> str:
    """Why these tensors cannot go to this MXFP4 artifact ("" when they can): dtypes, contiguity,
    base alignment the kernel's cp.async / vector loads need."""
    import torch
    want = dict(x=torch.bfloat16, ids=torch.int32, w=torch.uint8, s=torch.uint8)
    for name, t in tensors.items():
        if name in want and t.dtype != want[name]:
            return f"{name} is {t.dtype}, the kernel takes {want[name]}"
        if not t.is_contiguous():
            return f"{name} is not contiguous"
        a = man.get("align", {}).get(name, 1)
        if t.data_ptr() % a:
            return f"{name} at {t.data_ptr():#x} is not {a}-byte aligned"
    return ""


def mxfp4_experts(gate_up: "Artifact", down: "Artifact", x, topk_ids, w13, w13_scale, w2, w2_scale,
                  beta: float, linear_beta: float, driver: Driver | None = None, pdl: bool = False):
    """The two MXFP4 expert GEMVs (gate-up with SiTU, then down): [N, K, L] in x.dtype (bf16),
    unweighted, on torch's current stream (CUDA-graph capturable: no host syncs). pdl: down starts
    while gate-up drains (Programmatic Dependent Launch; moe.cute_pdl decides)."""
    import torch
    N, K = topk_ids.shape
    L, I = x.shape[1], w13.shape[1] // 2
    P = N * K
    sg, sd = gate_up.man["shapes"], down.man["shapes"]
    if (sg["I"], sg["L"], sg["K"]) != (I, L, K) or (sd["I"], sd["L"]) != (I, L):
        raise ValueError(f"artifacts {gate_up.path.stem} / {down.path.stem} are for I={sg['I']} L={sg['L']} "
                         f"K={sg['K']}; got I={I} L={L} K={K}")
    shapes = {"w13": (w13, (2 * I, L // 2)), "w13_scale": (w13_scale, (2 * I, L // 32)),
              "w2": (w2, (L, I // 2)), "w2_scale": (w2_scale, (L, I // 32))}
    for name, (t, want) in shapes.items():
        if t.dim() != 3 or tuple(t.shape[1:]) != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [E, {want[0]}, {want[1]}]")
    mid_dt = gate_up.man.get("mid", "f32")
    if down.man.get("mid", "f32") != mid_dt:
        raise ValueError(f"artifacts {gate_up.path.stem} / {down.path.stem} disagree on mid's dtype")
    out = torch.empty(N, K, L, dtype=x.dtype, device=x.device)
    if P == 0:
        return out
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32:
        ids = ids.to(torch.int32)
    ids = ids.contiguous()
    mid = torch.empty(P, I, dtype=torch.bfloat16 if mid_dt == "bf16" else torch.float32, device=x.device)
    for art, ts in ((gate_up, dict(x=x, ids=ids, w=w13, s=w13_scale, out=mid)),
                    (down, dict(x=mid, ids=ids, w=w2, s=w2_scale, out=out))):
        why = mxfp4_check(art.man, {k: v for k, v in ts.items() if not (art is down and k == "x")})
        if why:
            raise ValueError(f"{art.path.stem}: {why}")
        vals = {k: v.data_ptr() for k, v in ts.items()}
        vals.update(beta=beta, linear_beta=linear_beta)
        art.launch_values(vals, dict(P=P), x.device, driver, pdl=pdl)
    return out


def find_mxfp4(art_dir: Path, I: int, L: int, K: int, math: str = "f32",
               tag: str = "") -> tuple["tuple[Artifact, Artifact] | None", str]:
    """The (gate_up, down) artifacts for these shapes and math ("f32" | "f16x2"), or (None, why);
    tag: a variant's (build.MXFP4_TAGS; its down is the untagged one where it has none), "" the
    default kernels."""
    art_dir = Path(art_dir)
    if not art_dir.is_dir():
        return None, f"no CuTe artifact directory {art_dir} (run python -m k3compile.kernels.cute.build)"
    found = {}
    for mf in sorted(art_dir.glob("mxfp4_*.json")):
        try:
            man = json.loads(mf.read_text())
        except ValueError:
            continue
        op, sh = man.get("variant", {}).get("op"), man.get("shapes", {})
        if man.get("probe") and knob("cute_probe") != "1":
            continue        # a timing probe with wrong results (build.MXFP4_TAGS): benchmarks only
        if (op in ("mxfp4_gate_up", "mxfp4_down") and man.get("math", "f32") == math and sh.get("I") == I and sh.get("L") == L
                and man.get("tag", "") == tag and (op == "mxfp4_down" or sh.get("K") == K)
                and mf.with_suffix(".cubin").exists()):
            found.setdefault(op, mf)
    if tag and found and len(found) < 2:     # a tag that changes one kernel: the other's untagged one
        plain = find_mxfp4(art_dir, I, L, K, math)[0]
        if plain is not None:
            found.setdefault("mxfp4_gate_up", plain[0].path)
            found.setdefault("mxfp4_down", plain[1].path)
    if len(found) < 2:
        what = math + (f" {tag!r}" if tag else "")
        return None, f"no CuTe MXFP4 {what} artifacts for I={I} L={L} K={K} in {art_dir} (have {sorted(found)})"
    return (Artifact(found["mxfp4_gate_up"]), Artifact(found["mxfp4_down"])), ""


_DRV: Driver | None = None


def _driver() -> Driver:
    global _DRV
    if _DRV is None:
        _DRV = Driver()
    return _DRV


def find(art_dir: Path, op: str, n: int, k: int, m: int) -> tuple[Artifact | None, str]:
    """The smallest-tile artifact for (op, N, K) that covers M, or (None, why)."""
    art_dir = Path(art_dir)
    if not art_dir.is_dir():
        return None, f"no CuTe artifact directory {art_dir} (run python -m k3compile.kernels.cute.build)"
    best = None
    for mf in sorted(art_dir.glob("*.json")):
        try:
            man = json.loads(mf.read_text())
        except ValueError:
            continue
        v, sh = man.get("variant", {}), man.get("shapes", {})
        if v.get("op") == op and sh.get("n") == n and sh.get("k") == k and m <= man.get("m_max", 0):
            if not mf.with_suffix(".cubin").exists():
                continue
            if best is None or man["m_max"] < best[1]:
                best = (mf, man["m_max"])
    if best is None:
        return None, f"no CuTe artifact for {op} N={n} K={k} M={m} in {art_dir}"
    return Artifact(best[0]), ""
