"""CuTe DSL kernels (issue 6), CPU side.

- AOT build: every variant compiles for sm_90a with no GPU; its PTX holds wgmma.mma_async
  (m64nMTk16 bf16) and the TMA load cp.async.bulk.tensor; the manifest's parameter list matches
  the PTX entry; the cubin is small; a second build hits the cache and a source change misses it.
  Needs nvidia-cutlass-dsl: skipped without it, except under CI (CI=true), where a missing DSL
  fails, so CI cannot pass these tests without running them.
- Loader (no DSL, no GPU): parameter packing against a built manifest with a fake TMA encoder,
  artifact lookup, and dispatch falling back with the reason.
- JIT path: build.ensure writes the same cubin / PTX / manifest as the AOT build and hits its
  cache the second time; dispatch (artifacts.find) builds a missing artifact on first use, but not
  with K3_KNOBS=cute_jit=0, without the DSL, for shapes the build has no variant for, or inside a CUDA
  graph capture (not memoised); a failed JIT build is a fallback reason.
"""
from __future__ import annotations

import json
import os
import struct

import pytest

from k3compile.config import knobs_text
import torch

from k3compile.kernels import cute, gemm, moe, tuning
from k3compile.kernels.cute import artifacts, dsl_available, loader

if not dsl_available():
    if os.environ.get("CI"):
        pytest.fail("nvidia-cutlass-dsl is not installed but CI must run the CuTe AOT tests "
                    "(.ci/run installs the 'cute' extra)", pytrace=False)
    pytest.skip("nvidia-cutlass-dsl not installed (pip install -e '.[cute]')", allow_module_level=True)

from k3compile.kernels.cute import build  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("cute_art")
    mans = build.build(out, log=lambda *_: None)
    return out, mans


def test_every_variant_compiles_with_wgmma_and_tma(built):
    out, mans = built
    assert set(mans) == {v["name"] for v in build.variants()} and len(mans) == 30
    for name, man in mans.items():
        if not name.startswith("skinny_gemm"):
            continue
        ptx = (out / f"{name}.ptx").read_text()
        mt = man["shapes"]["mt"]
        assert ".target sm_90a" in ptx, name
        assert f"wgmma.mma_async.sync.aligned.m64n{mt}k16.f32.bf16.bf16" in ptx, name
        assert "cp.async.bulk.tensor.2d.shared::cta.global" in ptx, name
        assert "mbarrier" in ptx and "wgmma.wait_group" in ptx, name
        symbol, params = build.ptx_entry_params(ptx)
        assert symbol == man["symbol"]
        assert [(p["size"], p["align"]) for p in params] == [(p["size"], p["align"]) for p in man["params"]]
        cubin = (out / f"{name}.cubin").read_bytes()
        assert cubin[:4] == b"\x7fELF" and 1000 < len(cubin) < 200_000, (name, len(cubin))
        assert man["smem"] <= 227 * 1024
        if man["variant"].get("push"):   # the push epilogue: vector stores, then fence, then release
            assert "st.global.v4.u32" in ptx and "st.shared.b16" in ptx, name
            i_st, i_fence = ptx.rindex("st.global.v4.u32"), ptx.index("fence.acq_rel.sys")
            assert i_st < i_fence < ptx.index("st.release.sys.global.u32"), name
            assert [p["kind"] for p in man["params"][:9]] == ["tma", "tma", "ptr", "ptr", "i32", "i32", "i32",
                                                              "i64", "i64"], name
        else:
            assert "st.release" not in ptx and "fence.acq_rel.sys" not in ptx, name


def test_push_params_pack_rank_world_and_offsets(built):
    out, mans = built
    man = mans["skinny_gemm_push_bf16_n7168_k1536_mt8"]
    assert man["variant"]["op"] == "oproj_push" and man["smem"] == 1024 + 8 * 64 * 64 * 2 + 8 * 8 * 64 * 2 + 1024 + 8 * 64 * 2
    vals = dict(ptrs=0x7F0000300000, epoch=0x7F0000400000, rank=1, world=8, half_elems=(1 << 22) - 8192,
                flag_off=(16 << 20) - (64 << 10))
    blobs = loader.pack_params(man, w=(0x7F0000000000, 7168, 1536), x=(0x7F0000100000, 3, 1536), m_valid=3,
                               values=vals, encode_tma=lambda spec: b"\0" * 128)
    got = [struct.unpack({8: "<q", 4: "<i"}[len(b)], b)[0] for b in blobs[2:9]]
    assert got == [vals["ptrs"], vals["epoch"], 3, 1, 8, vals["half_elems"], vals["flag_off"]]
    # the plain GEMM's artifact is never picked for the push op, nor the other way round
    art, _ = loader.find(out, "oproj_push", 7168, 1536, 5)
    assert art is not None and art.path.stem == "skinny_gemm_push_bf16_n7168_k1536_mt8"
    assert loader.find(out, "oproj_gemm", 7168, 1536, 5)[0].path.stem == "skinny_gemm_bf16_n7168_k1536_mt8"


def test_cache_hits_and_misses(built, monkeypatch):
    out, mans = built
    logs = []
    build.build(out, only="skinny_gemm_bf16_n7168_k1536_mt16", log=logs.append)
    assert logs == ["skinny_gemm_bf16_n7168_k1536_mt16: cached"]
    v = next(v for v in build.variants() if v["name"].endswith("k1536_mt16"))
    assert build.cache_key(v) == mans[v["name"]]["key"]
    assert build.cache_key(dict(v, stages=4)) != build.cache_key(v)
    monkeypatch.setattr(build, "dsl_version", lambda: "0.0-other")
    assert build.cache_key(v) != mans[v["name"]]["key"]


def test_ptx_param_parser():
    ptx = (".visible .entry k(\n\t.param .align 64 .b8 k_param_0[128],\n\t.param .align 8 .b8 k_param_1[8],\n"
           "\t.param .u32 k_param_2,\n\t.param .align 1 .b8 k_param_3[1]\n)\n{")
    assert build.ptx_entry_params(ptx) == ("k", [dict(size=128, align=64), dict(size=8, align=8),
                                                 dict(size=4, align=4), dict(size=1, align=1)])


def test_pack_params_against_built_manifest(built):
    out, mans = built
    man = mans["skinny_gemm_bf16_n7168_k6144_mt32"]
    seen = []

    def fake_encode(spec):
        seen.append(spec)
        return bytes([len(seen)]) * 128

    w, x, o = 0x7F0000000000, 0x7F0000100000, 0x7F0000200000
    blobs = loader.pack_params(man, w=(w, 7168, 6144), x=(x, 20, 6144), out=o, m_valid=20, encode_tma=fake_encode)
    assert [len(b) for b in blobs] == [p["size"] for p in man["params"]] == [128, 128, 8, 4, 1]
    assert blobs[0] == b"\x01" * 128 and blobs[1] == b"\x02" * 128
    assert struct.unpack("<Q", blobs[2])[0] == o and struct.unpack("<i", blobs[3])[0] == 20
    sw, sx = seen
    # weight [N=7168, K] row-major: dims innermost first, row pitch in bytes, 64 x 64 box
    assert (sw.addr, sw.dims, sw.strides, sw.box) == (w, (6144, 7168), (6144 * 2,), (64, 64))
    # tokens: the real M rows (TMA zero-fills up to the 32-row box)
    assert (sx.addr, sx.dims, sx.strides, sx.box) == (x, (6144, 20), (6144 * 2,), (64, 32))
    assert sw.dtype == loader.TMA_DTYPE["bf16"] and sw.swizzle == 3 and sw.oob == 0
    # the enum values come from the driver's own bindings where installed (the cute extra brings
    # them), else from cuda.h; a wrong one (bf16 was once FLOAT32_FTZ = 10) fails only on the GPU
    try:
        from cuda.bindings import driver as cud
        names = {"bf16": "BFLOAT16", "fp16": "FLOAT16", "fp32": "FLOAT32", "u8": "UINT8"}
        want = {k: int(getattr(cud.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{n}")) for k, n in names.items()}
    except ImportError:
        want = {"bf16": 9, "fp16": 6, "fp32": 7, "u8": 0}
    assert loader.TMA_DTYPE == want
    assert loader.grid(man, 7168) == (112, 1, 1)
    with pytest.raises(ValueError, match="16-byte"):
        loader.pack_params(man, w=(w + 2, 7168, 6144), x=(x, 20, 6144), out=o, m_valid=20, encode_tma=fake_encode)
    bad = json.loads(json.dumps(man))
    bad["params"][2]["size"] = 4
    with pytest.raises(ValueError, match="expects 4"):
        loader.pack_params(bad, w=(w, 7168, 6144), x=(x, 20, 6144), out=o, m_valid=20, encode_tma=fake_encode)


def test_params_storage_is_aligned():
    p = loader._Params([b"a" * 128, b"b" * 8])
    assert all(a % 64 == 0 for a in p.array)
    import ctypes
    assert ctypes.string_at(p.array[0], 128) == b"a" * 128 and ctypes.string_at(p.array[1], 8) == b"b" * 8


class _FakeCu:
    """Records the driver launches a Driver makes (no GPU)."""

    def __init__(self):
        self.calls = []

    def cuLaunchKernel(self, fn, *args):
        self.calls.append(("plain", fn, args[:7]))
        return 0

    def cuLaunchKernelEx(self, cfg_ref, fn, params, extra):
        import ctypes
        cfg = ctypes.cast(cfg_ref, ctypes.POINTER(loader.LaunchConfig)).contents
        attrs = [cfg.attrs[i] for i in range(cfg.numAttrs)]
        self.calls.append(("ex", fn, (tuple(cfg.grid), tuple(cfg.block), cfg.sharedMemBytes, cfg.hStream,
                                      [(a.id, struct.unpack("<i", ctypes.string_at(ctypes.addressof(a) + 8, 4))[0]) for a in attrs])))
        return 0


def test_pdl_launch_config_layout_and_use(built, monkeypatch):
    """The down GEMV is launched with Programmatic Dependent Launch (cuLaunchKernelEx with the
    programmatic-stream-serialisation attribute = 1) when asked (moe.cute_pdl); gate-up never is. The
    ctypes structs have cuda.h's x86-64 layout (CUlaunchAttribute 72 bytes, CUlaunchConfig 56)."""
    import ctypes
    import types
    assert ctypes.sizeof(loader.LaunchAttribute) == 72 and loader.LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(loader.LaunchConfig) == 56
    assert [loader.LaunchConfig.hStream.offset, loader.LaunchConfig.attrs.offset,
            loader.LaunchConfig.numAttrs.offset] == [32, 40, 48]
    out, _ = built
    gu, dn = loader.find_mxfp4(out, 384, 3584, 16, math="f16x2")[0]
    drv = loader.Driver.__new__(loader.Driver)
    drv.cu, drv.has_launch_ex = _FakeCu(), True
    gu._fn[0], dn._fn[0] = gu.man["symbol"], dn.man["symbol"]      # "loaded" on device 0
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0x77))
    vals = dict(x=0x1000, ids=0x2000, w=0x3000, s=0x4000, out=0x5000, beta=4.0, linear_beta=25.0)
    dev = torch.device("cuda", 0)
    for pdl, want_down in ((True, "ex"), (False, "plain")):
        drv.cu.calls.clear()
        gu.launch_values(vals, dict(P=16), dev, drv, pdl=pdl)      # gate-up: never (it does not wait)
        dn.launch_values(vals, dict(P=16), dev, drv, pdl=pdl)
        (k1, f1, _), (k2, f2, a2) = drv.cu.calls
        assert (k1, f1) == ("plain", gu.man["symbol"]) and (k2, f2) == (want_down, dn.man["symbol"]), pdl
        if k2 == "ex":
            assert a2 == (loader.grid_of(dn.man, P=16), tuple(dn.man["block"]), dn.man["smem"], 0x77,
                          [(loader.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1)])
    drv.has_launch_ex = False           # an old driver: a plain launch (griddepcontrol is a no-op then)
    drv.cu.calls.clear()
    dn.launch_values(vals, dict(P=16), dev, drv, pdl=True)
    assert drv.cu.calls[0][0] == "plain"


def test_launch_push_packs_this_ranks_view_and_refuses_the_plain_kernel(built, monkeypatch):
    """launch_push: grid N/64, the manifest's smem, and the parameters the kernel declares from
    this rank's Peers (address table, epoch, rank, world, half size in elements, flag offset);
    launch_gemm refuses a push artifact and launch_push a plain one."""
    import ctypes
    import types

    from k3compile.kernels.comm import Peers
    out, _ = built
    art = loader.find(out, "oproj_push", 7168, 1536, 3)[0]
    plain = loader.find(out, "oproj_gemm", 7168, 1536, 3)[0]
    seen = {}

    class Cu(_FakeCu):
        def cuLaunchKernel(self, fn, *args):
            seen["grid"], seen["smem"] = args[:3], args[6].value
            arr = ctypes.cast(args[8], ctypes.POINTER(ctypes.c_void_p))
            seen["params"] = [ctypes.string_at(arr[i], p["size"]) for i, p in enumerate(art.man["params"])]
            return 0
    drv = loader.Driver.__new__(loader.Driver)
    drv.cu, drv.has_launch_ex = Cu(), True
    drv.encode_tma = lambda spec: b"\0" * 128
    art._fn[0] = art.man["symbol"]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    x = torch.zeros(3, 1536, dtype=torch.bfloat16)
    w = torch.zeros(7168, 1536, dtype=torch.bfloat16)
    x.__class__ = type("OnDev0", (torch.Tensor,), {"device": property(lambda self: torch.device("cuda", 0))})
    peers = Peers(torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64), torch.zeros(3, dtype=torch.int32),
                  rank=5, world=8, nbytes=1 << 24, programs=64, flag_off=(1 << 24) + 4096)
    art.launch_push(x, w, peers, peers.flag_off, driver=drv)
    assert seen["grid"] == (112, 1, 1) and seen["smem"] == art.man["smem"]
    got = [struct.unpack({8: "<q", 4: "<i"}[len(b)], b)[0] for b in seen["params"][2:9]]
    assert got == [peers.ptrs.data_ptr(), peers.epoch.data_ptr(), 3, 5, 8, (1 << 24) // 2 // 2, (1 << 24) + 4096]
    with pytest.raises(ValueError, match="is a push GEMM"):
        art.launch_gemm(x, w)
    with pytest.raises(ValueError, match="is not a push GEMM"):
        plain.launch_push(x, w, peers, peers.flag_off, driver=drv)
    with pytest.raises(ValueError, match="M<=8"):
        art.launch_push(torch.zeros(9, 1536, dtype=torch.bfloat16), w, peers, peers.flag_off, driver=drv)


def test_find_picks_smallest_covering_tile(built, tmp_path):
    out, _ = built
    for m, mt in ((1, 8), (8, 8), (9, 16), (17, 32), (64, 64)):
        art, why = loader.find(out, "oproj_gemm", 7168, 1536, m)
        assert art is not None and art.man["m_max"] == mt, (m, why)
    art, why = loader.find(out, "oproj_gemm", 7168, 1536, 65)
    assert art is None and "M=65" in why
    assert loader.find(tmp_path / "nope", "oproj_gemm", 7168, 1536, 1)[1].startswith("no CuTe artifact directory")


def test_dispatch_default_is_torch_and_forced_falls_back_with_reason(monkeypatch, tmp_path):
    # the skinny GEMM measured no faster than cuBLAS: no range; the MXFP4 experts have theirs
    assert "oproj" not in tuning.CUTE_M and set(tuning.CUTE_M) == {"mxfp4_experts"}
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute=""))
    assert not artifacts.wanted("oproj", 1)
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute="1"))
    assert artifacts.wanted("oproj", 1)
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute="0"))
    monkeypatch.setitem(tuning.CUTE_M, "oproj", (1, 64))
    assert not artifacts.wanted("oproj", 1)
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute=""))
    assert artifacts.wanted("oproj", 64) and not artifacts.wanted("oproj", 65)
    # on CPU the CuTe path is never taken: the result is torch.mm's
    x, w = torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16)
    torch.testing.assert_close(gemm.gemm("oproj", x, w), torch.mm(x, w.t()))
    # a wanted call on a "CUDA" tensor with no artifact falls back to torch.mm with the reason
    monkeypatch.setenv("K3_CUTE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute_jit=""))
    artifacts._WHY.clear()
    xc = x.as_subclass(FakeCuda)
    got = gemm.gemm("oproj", xc, w)
    torch.testing.assert_close(got.as_subclass(torch.Tensor), torch.mm(x, w.t()))
    why = artifacts.fallbacks()
    assert list(why) == ["oproj N=8 K=16 M=3"] and "no CuTe artifact directory" in why["oproj N=8 K=16 M=3"]
    assert "no JIT build: the CuTe build has no variant for these shapes" in why["oproj N=8 K=16 M=3"]


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA, so dispatch looks for a CuTe kernel."""
    @property
    def is_cuda(self):
        return True


# ---------------------------------------------------------------- MXFP4 expert GEMV (mxfp4_experts.py)

def _sass_text(cubin_path):
    """The cubin's SASS with Triton's bundled cuobjdump (None where it is missing)."""
    import subprocess
    try:
        import triton
    except ImportError:
        return None
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    return subprocess.run([tool, "-sass", str(cubin_path)], capture_output=True, text=True, check=True).stdout


def _sass(cubin_path):
    """SASS opcode counts of a cubin (None where cuobjdump is missing)."""
    import collections
    import re
    txt = _sass_text(cubin_path)
    if txt is None:
        return None
    ops = re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_]+)", txt, re.M)
    return collections.Counter(ops)


def _check_down_reads_mid_after_wait(name, ptx, cubin_path):
    """Down's mid loads: coherent (ld.global, not .nc) and, in the SASS, every 16-byte global load
    after ACQBULK (griddepcontrol.wait). ptxas hoisted .nc loads above it in a 16-rows-per-thread
    down kernel, which then read mid before gate-up had written it (04ea468, with PDL only)."""
    assert "ld.global.nc.v4" not in ptx and ptx.index("griddepcontrol.wait") < ptx.index("ld.global.v4.u32"), name
    txt = _sass_text(cubin_path)
    if txt is not None:
        wait = txt.index("ACQBULK")
        assert "LDG.E.128" in txt and "LDG.E.128" not in txt[:wait], name


def test_mxfp4_variants_compile_to_streaming_gemv(built):
    out, mans = built
    names = [v["name"] for v in build.mxfp4_variants() if not v["tag"]]
    assert len(names) == 8 and {mans[n]["variant"]["op"] for n in names} == {"mxfp4_gate_up", "mxfp4_down"}
    for name in names:
        man, v = mans[name], mans[name]["variant"]
        ptx = (out / f"{name}.ptx").read_text()
        assert ".target sm_90a" in ptx, name
        rpg = (2 * v["rows"] if v["mode"] == "gate_up" else v["rows"]) // v["groups"]
        # every weight row: one 16-byte cp.async per thread, in `stages` commit groups; scales by 4 B
        assert ptx.count("cp.async.cg.shared.global") == rpg, name
        assert "cp.async.ca.shared.global" in ptx and ptx.count("cp.async.commit_group") == v["stages"], name
        assert ("ld.global.nc.v4.u32" if v["mode"] == "gate_up" else "ld.global.v4.u32") in ptx, name
        assert "ld.shared.v4.u32" in ptx, name
        if v["math"] == "f32":
            # two fp32 FMAs per code pair, never flushing subnormal inputs (+-0.5 * 2^-126)
            assert ptx.count("fma.rn.f32") >= rpg * 32 and "fma.rn.ftz" not in ptx, name
        else:
            # one f16x2 FMA per code pair, the pairs' activations packed once per thread
            assert ptx.count("fma.rn.f16x2") == rpg * 16 and ptx.count("cvt.rn.f16x2.f32") == 16, name
        # Programmatic Dependent Launch: gate-up lets down start once its own loads are issued;
        # down issues every weight load, then waits, then reads mid (the activations)
        if v["mode"] == "gate_up":
            assert ptx.count("griddepcontrol.launch_dependents") == 1 and "griddepcontrol.wait" not in ptx, name
            assert ptx.index("griddepcontrol.launch_dependents") > ptx.rindex("cp.async.cg.shared.global"), name
            assert man["pdl"] == "trigger", name
        else:
            assert ptx.count("griddepcontrol.wait") == 1 and "launch_dependents" not in ptx, name
            assert ptx.rindex("cp.async.cg.shared.global") < ptx.index("griddepcontrol.wait"), name
            _check_down_reads_mid_after_wait(name, ptx, out / f"{name}.cubin")
            assert man["pdl"] == "wait", name
        assert ".minnctapersm 1" in ptx, name
        assert "ld.local" not in ptx and "st.local" not in ptx, name
        assert f".reqntid {man['block'][0]}, 1, 1" in ptx, name
        symbol, params = build.ptx_entry_params(ptx)
        assert symbol == man["symbol"] and [p["size"] for p in params] == [8, 8, 8, 8, 8, 4, 4]
        assert [p["kind"] for p in man["params"]] == ["ptr"] * 5 + ["f32"] * 2
        assert man["smem"] <= 227 * 1024 and man["block"][0] <= 1024
        sass = _sass(out / f"{name}.cubin")
        if sass is not None:
            assert sass["LDGSTS"] >= rpg and sass["LDL"] == 0 and sass["STL"] == 0, (name, sass)
            # the dequantisation + FMA body per weight byte over the kernel: f32 ~7.7, f16x2 ~5.3
            body = sum(sass[o] for o in ("LOP3", "IMAD", "FFMA", "HFMA2", "SHF", "PRMT"))
            assert body <= (8 if v["math"] == "f32" else 6) * rpg * 16, (name, body, rpg * 16)


def test_mxfp4_variants_by_tag_compile_as_described(tmp_path):
    """The f16x2 kernels by tag: "" stores mid as bf16 in gate-up and reads 64 bytes of it per
    thread in down; "xf" (a gate-up only, built by default) emits its activation loads (ordered)
    ahead of the first weight cp.async; "m32" (build --alt) keeps mid in fp32 (128 bytes); "sh"
    (build --alt) dequantises with shifts, every other one with one byte permute per code pair."""
    mans = build.build(tmp_path, alt=True, only="i384", log=lambda *_: None)
    mans.update(build.build(tmp_path, alt=True, only="_dn2x", log=lambda *_: None))
    dn2x = next(v for v in build.mxfp4_variants(alt=True) if v["tag"] == "dn2x")
    _check_down_reads_mid_after_wait(dn2x["name"], (tmp_path / f"{dn2x['name']}.ptx").read_text(),
                                     tmp_path / f"{dn2x['name']}.cubin")
    vs = [v for v in build.mxfp4_variants(alt=True) if v["I"] == 384 and v["math"] == "f16x2"
          and v["tag"] in ("", "xf", "m32", "sh")]
    assert sorted((v["tag"], v["mode"]) for v in vs) == [("", "down"), ("", "gate_up"), ("m32", "down"),
                                                         ("m32", "gate_up"), ("sh", "down"), ("sh", "gate_up"),
                                                         ("xf", "gate_up")]
    tiles = {(v["I"], v["tag"], v["mode"]): v["rows"] for v in build.mxfp4_variants(alt=True) if v["tag"] == "dn2x"}
    assert tiles == {(1536, "dn2x", "down"): 64}
    assert not any(v["tag"] == "m32" for v in build.mxfp4_variants())      # alternates only with --alt
    for v in vs:
        man, ptx = mans[v["name"]], (tmp_path / f"{v['name']}.ptx").read_text()
        assert man["tag"] == v["tag"] and man["mid"] == v["mid"] == ("f32" if v["tag"] == "m32" else "bf16")
        assert v["name"].endswith("_h2" + (f"_{v['tag']}" if v["tag"] else ""))
        first_w = ptx.index("cp.async.cg.shared.global")
        # the byte-permute dequantisation (all but "sh"): one prmt per code pair (as many as the FMAs)
        n_fma = 16 * (2 * v["rows"] if v["mode"] == "gate_up" else v["rows"]) // v["groups"]
        assert ptx.count("prmt.b32") == (0 if v["tag"] == "sh" else n_fma), v["name"]
        assert v["deq"] == ("shift" if v["tag"] == "sh" else "prmt")
        if v["mode"] == "gate_up":
            assert ptx.count("ld.global.nc.v4.u32") == 4 and v["x_first"] == (v["tag"] == "xf")
            assert (ptx.index("ld.global.nc.v4.u32") < first_w) == v["x_first"], v["name"]
            assert ("st.global.b16" in ptx) == (v["mid"] == "bf16") and ("st.global.f32" in ptx) != (v["mid"] == "bf16")
        else:
            assert ptx.count("ld.global.v4.u32") == (4 if v["mid"] == "bf16" else 8), v["name"]
            assert first_w < ptx.index("griddepcontrol.wait")
            _check_down_reads_mid_after_wait(v["name"], ptx, tmp_path / f"{v['name']}.cubin")
        assert "ld.local" not in ptx and ptx.count("fma.rn.f16x2") == n_fma
    xf, why = loader.find_mxfp4(tmp_path, 384, 3584, 16, "f16x2", "xf")
    assert xf is not None and xf[0].man["tag"] == "xf" and xf[1].man["tag"] == "", why   # the untagged down
    m32, why = loader.find_mxfp4(tmp_path, 384, 3584, 16, "f16x2", "m32")
    assert m32 is not None and [a.man["mid"] for a in m32] == ["f32", "f32"], why


def test_mxfp4_register_staged_tags_and_probes(tmp_path, monkeypatch):
    """"ldgd" (built by default; moe.mxfp4_tag takes it at small batches) loads both kernels'
    weight vectors with ordered read-only loads into registers: no weight cp.async, shared memory
    only for scales and partials, one f16x2 FMA per code pair; down's mid loads
    stay coherent and after griddepcontrol.wait. "ldg" is its gate-up alone. The probes are marked
    and the loader serves them only with K3_KNOBS=cute_probe=1."""
    mans = build.build(tmp_path, alt=True, only="i384", log=lambda *_: None)
    vs = {(v["tag"], v["mode"]): v for v in build.mxfp4_variants(alt=True) if v["I"] == 384 and v["math"] == "f16x2"}
    assert {t for t, _ in vs} >= {"", "xf", "ldgd", "ldg", "m32", "sh", "nomath", "noload"}
    assert ("ldgd", "down") in vs and ("ldg", "down") not in vs and not vs[("ldgd", "down")].get("probe")
    assert {v["tag"] for v in build.mxfp4_variants()} == {"", "xf", "ldgd"}        # the default build
    ptx = {k: (tmp_path / f"{v['name']}.ptx").read_text() for k, v in vs.items()}
    for mode in ("gate_up", "down"):
        v, plain = vs[("ldgd", mode)], vs[("", mode)]
        rpg = (2 * v["rows"] if mode == "gate_up" else v["rows"]) // v["groups"]
        p = ptx[("ldgd", mode)]
        assert p.count("ld.global.nc.L1::no_allocate.v4.u32") == rpg and "cp.async.cg" not in p, mode
        assert p.count("fma.rn.f16x2") == 16 * rpg, mode          # one per code pair, as the cp.async kernels
        # shared memory: scales and partials only (gate-up: 32 rows per CTA, twice the default's)
        assert mans[v["name"]]["smem"] < mans[plain["name"]]["smem"] * v["rows"] // plain["rows"] // 2, mode
    dn = vs[("ldgd", "down")]["name"]      # (its weight loads are LDG.E.NA.128.CONSTANT in the SASS)
    _check_down_reads_mid_after_wait(dn, ptx[("ldgd", "down")], tmp_path / f"{dn}.cubin")
    assert ptx[("ldg", "gate_up")] == ptx[("ldgd", "gate_up")].replace(vs[("ldgd", "gate_up")]["name"],
                                                                        vs[("ldg", "gate_up")]["name"])
    assert "fma.rn.f16x2" not in ptx[("nomath", "gate_up")]
    assert all(bool(mans[v["name"]]["probe"]) == (t in ("nomath", "noload", "ldgnm", "ldgnl"))
               for (t, _), v in vs.items())
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute_probe=""))
    assert loader.find_mxfp4(tmp_path, 384, 3584, 16, "f16x2", "nomath")[0] is None
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute_probe="1"))
    arts, why = loader.find_mxfp4(tmp_path, 384, 3584, 16, "f16x2", "nomath")
    assert arts is not None and arts[0].man["probe"] == "nomath" and arts[1].man["tag"] == "", why
    arts, why = loader.find_mxfp4(tmp_path, 384, 3584, 16, "f16x2", "ldgd")
    assert arts is not None and [a.man["tag"] for a in arts] == ["ldgd", "ldgd"], why
    # dispatch: ldgd up to CUTE_MXFP4_LDG[I] tokens, then xf up to CUTE_XF_MAX_N, then untagged
    assert [moe.mxfp4_tag(384, n) for n in (1, 16, 17)] == ["ldgd", "ldgd", ""]
    assert [moe.mxfp4_tag(1536, n) for n in (1, 16, 17)] == ["ldgd", "ldgd", ""]
    assert [moe.mxfp4_tag(512, n) for n in (1, 2, 3)] == ["xf", "xf", ""]


def test_mxfp4_manifest_packs_and_finds(built, tmp_path):
    out, mans = built
    arts, why = loader.find_mxfp4(out, 384, 3584, 16)
    assert arts is not None, why
    gu, dn = arts
    assert gu.man["variant"]["op"] == "mxfp4_gate_up" and dn.man["variant"]["op"] == "mxfp4_down"
    assert loader.grid_of(gu.man, P=16) == (16, 384 // gu.man["shapes"]["rows"], 1)
    assert loader.grid_of(dn.man, P=16) == (16, 3584 // dn.man["shapes"]["rows"], 1)
    vals = dict(x=0x1000, ids=0x2000, w=0x3000, s=0x4000, out=0x5000, beta=4.0, linear_beta=25.0)
    blobs = loader.pack_values(gu.man, vals)
    assert [struct.unpack("<Q", b)[0] for b in blobs[:5]] == [0x1000, 0x2000, 0x3000, 0x4000, 0x5000]
    assert [struct.unpack("<f", b)[0] for b in blobs[5:]] == [4.0, 25.0]
    assert loader.find_mxfp4(out, 384, 3584, 8)[0] is None       # top-k is compiled into gate-up
    assert loader.find_mxfp4(out, 1536, 3584, 16)[0] is not None
    h2, why = loader.find_mxfp4(out, 384, 3584, 16, math="f16x2")
    assert h2 is not None and all(a.man["math"] == "f16x2" and a.path.stem.endswith("_h2") for a in h2), why
    assert all(a.man["tag"] == "" for a in h2)
    assert all(a.man["mid"] == "bf16" for a in h2) and all(a.man["mid"] == "f32" for a in arts)
    assert "'m32'" in loader.find_mxfp4(out, 384, 3584, 16, "f16x2", "m32")[1]    # alternates: build --alt
    assert loader.find_mxfp4(out, 384, 3584, 16, "f16x2", "xf")[0][0].man["variant"]["x_first"]
    assert all(a.man["math"] == "f32" for a in arts)
    assert "no CuTe artifact directory" in loader.find_mxfp4(tmp_path / "nope", 384, 3584, 16)[1]


def test_mxfp4_dispatch_without_its_tagged_artifacts_runs_the_untagged_ones(built, tmp_path, monkeypatch):
    """An artifact directory without the variant dispatch picks (built before "ldgd" existed): the
    untagged CuTe kernels run, with the reason in fallbacks(); a tag forced by K3_KNOBS cute_mxfp4_tag
    does not fall back (benchmarks must not time another kernel)."""
    import shutil
    out, _ = built
    _no_packaged(monkeypatch, tmp_path)
    old = tmp_path / "old"
    old.mkdir()
    for f in out.iterdir():
        if "_h2" in f.name and "i384" in f.name and not any(t in f.name for t in ("_xf", "_ldgd")):
            shutil.copy(f, old / f.name)
    monkeypatch.setenv("K3_CUTE_DIR", str(old))
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute_jit="0"))
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute_mxfp4_tag=""))
    monkeypatch.setattr(artifacts, "_FOUND", {})
    monkeypatch.setattr(artifacts, "_WHY", {})
    got = []
    monkeypatch.setattr(loader, "mxfp4_experts", lambda gu, dn, *a, **k: got.append((gu.man["tag"], dn.man["tag"])) or "ran")
    E, I, L = 2, 384, 3584
    x = torch.zeros(1, L, dtype=torch.bfloat16).as_subclass(FakeCuda)
    ids = torch.zeros(1, 16, dtype=torch.int32)
    w13, s13 = torch.zeros(E, 2 * I, L // 2, dtype=torch.uint8), torch.zeros(E, 2 * I, L // 32, dtype=torch.uint8)
    w2, s2 = torch.zeros(E, L, I // 2, dtype=torch.uint8), torch.zeros(E, L, I // 32, dtype=torch.uint8)
    with pytest.warns(UserWarning, match="running the untagged CuTe kernels"):
        assert moe.mxfp4_experts_cute(x, ids, w13, s13, w2, s2, 4.0, 25.0, math="f16x2") == "ran"
    assert got == [("", "")]
    assert list(artifacts.fallbacks()) == ["mxfp4_experts I=384 L=3584 K=16 f16x2 ldgd"]
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute_mxfp4_tag="ldgd"))
    assert moe.mxfp4_experts_cute(x, ids, w13, s13, w2, s2, 4.0, 25.0, math="f16x2") is None and got == [("", "")]


def test_dispatch_memoises_artifacts(built, monkeypatch):
    """choose keeps one Artifact per (dir, shapes): a fresh one per call would load a new module
    every call (and call cuModuleLoadData inside CUDA-graph captures)."""
    out, _ = built
    monkeypatch.setenv("K3_CUTE_DIR", str(out))
    monkeypatch.setattr(artifacts, "_FOUND", {})
    a1, _ = artifacts.find("mxfp4", 384, 3584, 16, "f32")
    a2, _ = artifacts.find("mxfp4", 384, 3584, 16, "f32")
    g1, _ = artifacts.find("gemm", "oproj_gemm", 7168, 1536, 4)
    assert a1 is a2 and a1 is not None and g1 is artifacts.find("gemm", "oproj_gemm", 7168, 1536, 4)[0]
    assert artifacts.find("mxfp4", 384, 3584, 16, "f16x2")[0] is not a1


# ---------------------------------------------------------------- JIT path (build.ensure, artifacts.find)

def _count_compiles(monkeypatch, fail: str = "") -> list[str]:
    """build.compile_variant wrapped to record the variants it compiles (or to raise `fail`)."""
    calls, real = [], build.compile_variant

    def compile_variant(v, out):
        calls.append(v["name"])
        if fail:
            raise RuntimeError(fail)
        return real(v, out)
    monkeypatch.setattr(build, "compile_variant", compile_variant)
    return calls


def _jit_env(monkeypatch, d):
    _no_packaged(monkeypatch, d)
    monkeypatch.setenv("K3_CUTE_DIR", str(d))
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute_jit=""))
    monkeypatch.setattr(artifacts, "_FOUND", {})
    monkeypatch.setattr(artifacts, "_WHY", {})


def test_jit_ensure_writes_the_aot_build_and_then_hits_its_cache(built, tmp_path, monkeypatch):
    out, _ = built
    v = next(v for v in build.mxfp4_variants() if v["mode"] == "gate_up" and v["I"] == 384 and v["math"] == "f32")
    name, d = v["name"], tmp_path / "jit"
    calls = _count_compiles(monkeypatch)
    mf = build.ensure(name, d)
    assert mf == d / f"{name}.json" and calls == [name]
    for ext in (".cubin", ".ptx"):
        assert (d / f"{name}{ext}").read_bytes() == (out / f"{name}{ext}").read_bytes(), ext

    def man(p):
        return {k: x for k, x in json.loads(p.read_text()).items() if k != "compile_s"}
    assert man(mf) == man(out / f"{name}.json")
    assert build.ensure(v, d) == mf and calls == [name]          # cached: not compiled again
    assert build.cached(v, d)["key"] == build.cache_key(v)
    with pytest.raises(KeyError, match="no CuTe build variant"):
        build.ensure("mxfp4_nope", d)


def test_jit_variants_cover_what_the_loader_looks_up():
    assert [v["name"] for v in build.jit_variants("gemm", "oproj_gemm", 7168, 1536, 9)] == \
        ["skinny_gemm_bf16_n7168_k1536_mt16"]
    assert build.jit_variants("gemm", "oproj_gemm", 7168, 1536, 65) == []
    assert build.jit_variants("gemm", "oproj_gemm", 8, 16, 3) == []
    m32 = build.jit_variants("mxfp4", 384, 3584, 16, "f16x2", "m32")
    assert len(m32) == 2 and all(v["tag"] == "m32" and v["mid"] == "f32" for v in m32)
    xf = build.jit_variants("mxfp4", 384, 3584, 16, "f16x2", "xf")
    assert [(v["x_first"], v["tag"]) for v in xf] == [(True, "xf"), (False, "")]    # the untagged down
    h2 = build.jit_variants("mxfp4", 384, 3584, 16, "f16x2")
    assert sorted(v["op"] for v in h2) == ["mxfp4_down", "mxfp4_gate_up"]
    assert all(v["I"] == 384 and v["math"] == "f16x2" for v in h2)
    assert build.jit_variants("mxfp4", 384, 3584, 8, "f32") == []   # top-k is compiled into gate-up


def test_dispatch_builds_a_missing_artifact_on_first_use(built, tmp_path, monkeypatch):
    out, _ = built
    d = tmp_path / "jit"
    _jit_env(monkeypatch, d)
    calls = _count_compiles(monkeypatch)
    art, why = artifacts.find("gemm", "oproj_gemm", 7168, 1536, 3)
    assert art is not None and art.man["m_max"] == 8, why
    assert calls == ["skinny_gemm_bf16_n7168_k1536_mt8"]
    assert art.cubin == (out / "skinny_gemm_bf16_n7168_k1536_mt8.cubin").read_bytes()
    assert artifacts.find("gemm", "oproj_gemm", 7168, 1536, 3)[0] is art    # memoised
    monkeypatch.setattr(artifacts, "_FOUND", {})
    assert artifacts.find("gemm", "oproj_gemm", 7168, 1536, 8)[0].path == art.path and len(calls) == 1  # on disk
    art, why = artifacts.find("gemm", "oproj_gemm", 7168, 1536, 65)
    assert art is None and why.endswith("no JIT build: the CuTe build has no variant for these shapes")
    assert len(calls) == 1


def test_jit_off_and_no_dsl_fall_back_with_the_reason(tmp_path, monkeypatch):
    d = tmp_path / "empty"
    _jit_env(monkeypatch, d)
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute="1"))
    monkeypatch.setenv("K3_KNOBS", knobs_text(gemv="0"))   # the default path is cuBLAS here (no tuned Triton GEMM on fake CUDA)
    calls = _count_compiles(monkeypatch)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1536, generator=g).bfloat16()
    w = (torch.randn(7168, 1536, generator=g) / 40).bfloat16()
    key = "oproj N=7168 K=1536 M=3"
    for env, dsl, reason in (("0", True, "JIT build off (K3_KNOBS=cute_jit=0)"),
                             (None, False, "no JIT build: the CuTe DSL is not installed")):
        if env is None:
            monkeypatch.setenv("K3_KNOBS", knobs_text(cute_jit=""))
        else:
            monkeypatch.setenv("K3_KNOBS", knobs_text(cute_jit=env))
        monkeypatch.setattr(cute, "dsl_available", lambda: dsl)
        monkeypatch.setattr(artifacts, "_FOUND", {})
        monkeypatch.setattr(artifacts, "_WHY", {})
        got = gemm.gemm("oproj", x.as_subclass(FakeCuda), w)
        torch.testing.assert_close(got.as_subclass(torch.Tensor), torch.mm(x, w.t()))
        why = artifacts.fallbacks()
        assert list(why) == [key] and why[key].startswith("no CuTe artifact directory"), why
        assert why[key].endswith(reason), why
    assert calls == [] and not d.exists()


def test_jit_never_inside_graph_capture_and_a_failed_build_is_the_reason(tmp_path, monkeypatch):
    _jit_env(monkeypatch, tmp_path / "jit")
    calls = _count_compiles(monkeypatch, fail="ptxas died")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    arts, why = artifacts.find("mxfp4", 384, 3584, 16, "f32")
    assert arts is None and why.endswith("not built just in time inside a CUDA graph capture"), why
    assert calls == [] and not artifacts._FOUND               # not memoised: the next eager call builds
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert artifacts.find("mxfp4", 384, 3584, 16, "f32") == (None, "JIT build failed: RuntimeError: ptxas died")
    assert len(calls) == 1
    assert artifacts.find("mxfp4", 384, 3584, 16, "f32")[1].startswith("JIT build failed")
    assert len(calls) == 1                                  # memoised: not retried on every call


def test_cute_pdl_on_unless_turned_off(monkeypatch):
    """PDL for the down kernel at every batch (it measured faster or equal everywhere with cold
    routings); K3_KNOBS=cute_pdl=0 turns it off."""
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute_pdl=""))
    assert moe.cute_pdl()
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute_pdl="1"))
    assert moe.cute_pdl()
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute_pdl="0"))
    assert not moe.cute_pdl()


def _no_packaged(monkeypatch, tmp_path):
    """A lookup that sees only the user's directory (the packaged artifacts would serve every shape)."""
    monkeypatch.setattr(artifacts, "packaged_dir", lambda: tmp_path / "no_packaged_artifacts")
    monkeypatch.setattr(artifacts, "_FOUND", {})


def test_packaged_artifacts_are_the_build_of_this_source():
    """The artifacts shipped in the package are every default variant of build.variants(), each with
    its cubin and a manifest whose key is this source's (kernel file, ptx.py, build.py, variant, the
    DSL version it was built with, sm_90a): a kernel or build change without a rebuild fails here.
    Rebuild: python -m k3compile.kernels.cute.build --out k3compile/kernels/cute/aot (then rm aot/*.ptx)."""
    import json
    d = artifacts.packaged_dir()
    mans = {mf.stem: json.loads(mf.read_text()) for mf in d.glob("*.json")}
    want = {v["name"]: v for v in build.variants()}
    assert set(mans) == set(want), (sorted(set(want) - set(mans)), sorted(set(mans) - set(want)))
    for name, man in mans.items():
        assert (d / f"{name}.cubin").stat().st_size > 1000, name
        assert man["key"] == build.cache_key(want[name], dsl=man["dsl"]), f"{name}: stale, rebuild"
        assert man["arch"] == "sm_90a"


def test_fresh_install_finds_the_packaged_artifacts_and_the_report_says_so(tmp_path, monkeypatch):
    """No K3_CUTE_DIR build (an empty user directory) and no DSL: the experts' and the o-proj GEMM's
    lookups find the packaged artifacts; the report's kernel note names where they came from."""
    from k3compile.kernels import cute
    from k3compile.kernels.moe import experts_note
    monkeypatch.setenv("K3_CUTE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("K3_KNOBS", knobs_text(cute_jit="0"))
    monkeypatch.setattr(artifacts, "_FOUND", {})
    monkeypatch.setattr(cute, "dsl_available", lambda: False)
    arts, why = artifacts.find("mxfp4", 384, 3584, 16, "f16x2")
    assert arts is not None, why
    assert all(a.path.parent == artifacts.packaged_dir() for a in arts)
    art, why = artifacts.find("gemm", "oproj_gemm", 7168, 1536, 3)
    assert art is not None and art.path.parent == artifacts.packaged_dir(), why
    assert "(packaged with k3compile)" in experts_note(384, 3584, 16, 1, True)
    # a user's build of the pair comes first (a pair is taken from one directory)
    (tmp_path / "user").mkdir()
    for a in arts:
        for f in a.path.parent.glob(a.path.stem + ".*"):
            (tmp_path / "user" / f.name).write_bytes(f.read_bytes())
    monkeypatch.setenv("K3_CUTE_DIR", str(tmp_path / "user"))
    monkeypatch.setattr(artifacts, "_FOUND", {})
    got, _ = artifacts.find("mxfp4", 384, 3584, 16, "f16x2")
    assert [a.path.parent for a in got] == [tmp_path / "user"] * 2
    assert "(" + str(tmp_path / "user") + ")" in experts_note(384, 3584, 16, 1, True)
