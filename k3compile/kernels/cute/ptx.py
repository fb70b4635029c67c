"""Inline-PTX helpers shared by the CuTe DSL kernels (global / shared loads and stores by raw
address, cp.async, Programmatic Dependent Launch, system-scope fences and release stores, bit
casts). The build's cache key hashes this file with each kernel's source (`build.cache_key`).
The DSL is imported by whoever imports this module."""
from __future__ import annotations

from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _asm(ret, args, text, cons, side=False):
    return llvm.inline_asm(ret, args, text, cons, has_side_effects=side, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def ld_v4(addr: Int64, *, loc=None, ip=None):
    """Four u32 words from a 16-byte aligned global address (read-only, streamed past L1)."""
    st = llvm.StructType.get_literal([T.i32()] * 4)
    r = _asm(st, [Int64(addr).ir_value(loc=loc, ip=ip)],
             "ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l")
    return [Int32(llvm.extractvalue(T.i32(), r, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def ld_v4_ordered(addr: Int64, *, loc=None, ip=None):
    """ld_v4 (read-only, streamed past L1) as a side-effecting asm: LLVM keeps it where it is
    emitted (a software pipeline's stage order); ptxas may still move it."""
    st = llvm.StructType.get_literal([T.i32()] * 4)
    r = _asm(st, [Int64(addr).ir_value(loc=loc, ip=ip)],
             "ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", side=True)
    return [Int32(llvm.extractvalue(T.i32(), r, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def ld_v4_keep(addr: Int64, ordered: bool = False, *, loc=None, ip=None):
    """Four u32 words from a 16-byte aligned global address (activations: read by many CTAs),
    through the non-coherent path: only for data no kernel still running writes (see ld_v4_dep).
    ordered: a side-effecting asm, which LLVM keeps where it is emitted (a pure one it may sink
    to its first use); ptxas may still move it."""
    st = llvm.StructType.get_literal([T.i32()] * 4)
    r = _asm(st, [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];",
             "=r,=r,=r,=r,l", side=ordered)
    return [Int32(llvm.extractvalue(T.i32(), r, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def ld_v4_dep(addr: Int64, *, loc=None, ip=None):
    """Four u32 words from a 16-byte aligned global address that the previous kernel in the stream
    wrote: a plain (coherent) load, ordered, for after `pdl_wait`. Not ld.global.nc: the
    non-coherent path promises the data is constant for the kernel's lifetime, and ptxas did hoist
    such loads above griddepcontrol.wait (a down kernel with 16 rows per thread read mid before
    gate-up had written it)."""
    st = llvm.StructType.get_literal([T.i32()] * 4)
    r = _asm(st, [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.global.v4.u32 {$0, $1, $2, $3}, [$4];",
             "=r,=r,=r,=r,l", side=True)
    return [Int32(llvm.extractvalue(T.i32(), r, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def pdl_trigger(*, loc=None, ip=None) -> None:
    """Programmatic Dependent Launch: this CTA lets the next kernel in the stream be scheduled
    (a no-op unless that kernel is launched with programmatic stream serialisation)."""
    _asm(None, [], "griddepcontrol.launch_dependents;", "", side=True)


@dsl_user_op
def pdl_wait(*, loc=None, ip=None) -> None:
    """Wait until the previous kernel in the stream has completed and its writes are visible (a
    no-op when this kernel was launched without programmatic stream serialisation)."""
    _asm(None, [], "griddepcontrol.wait;", "~{memory}", side=True)


@dsl_user_op
def cp_async16(dst: Int32, src: Int64, *, loc=None, ip=None) -> None:
    """16 bytes global -> shared, asynchronous, bypassing L1 (cp.async.cg)."""
    _asm(None, [Int32(dst).ir_value(loc=loc, ip=ip), Int64(src).ir_value(loc=loc, ip=ip)],
         "cp.async.cg.shared.global [$0], [$1], 16;", "r,l", side=True)


@dsl_user_op
def cp_async4(dst: Int32, src: Int64, *, loc=None, ip=None) -> None:
    _asm(None, [Int32(dst).ir_value(loc=loc, ip=ip), Int64(src).ir_value(loc=loc, ip=ip)],
         "cp.async.ca.shared.global [$0], [$1], 4;", "r,l", side=True)


@dsl_user_op
def cp_async_commit(*, loc=None, ip=None) -> None:
    _asm(None, [], "cp.async.commit_group;", "", side=True)


@dsl_user_op
def cp_async_wait(n: int, *, loc=None, ip=None) -> None:
    _asm(None, [], f"cp.async.wait_group {int(n)};", "", side=True)


@dsl_user_op
def lds_v4(addr: Int32, *, loc=None, ip=None):
    st = llvm.StructType.get_literal([T.i32()] * 4)
    r = _asm(st, [Int32(addr).ir_value(loc=loc, ip=ip)], "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];",
             "=r,=r,=r,=r,r", side=True)
    return [Int32(llvm.extractvalue(T.i32(), r, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def lds_u8(addr: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), [Int32(addr).ir_value(loc=loc, ip=ip)], "ld.shared.u8 $0, [$1];", "=r,r", side=True))


@dsl_user_op
def ld_u8(addr: Int64, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.global.nc.u8 $0, [$1];", "=r,l"))


@dsl_user_op
def ld_s32(addr: Int64, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.global.nc.s32 $0, [$1];", "=r,l"))


@dsl_user_op
def st_f32(addr: Int64, v: Float32, *, loc=None, ip=None) -> None:
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Float32(v).ir_value(loc=loc, ip=ip)],
         "st.global.f32 [$0], $1;", "l,f", side=True)


@dsl_user_op
def st_bf16(addr: Int64, v: Float32, *, loc=None, ip=None) -> None:
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Float32(v).ir_value(loc=loc, ip=ip)],
         "{ .reg .b16 h; cvt.rn.bf16.f32 h, $1; st.global.b16 [$0], h; }", "l,f", side=True)


@dsl_user_op
def as_f32(bits: Int32, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.bitcast(T.f32(), Int32(bits).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def as_i32(v: Float32, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.bitcast(T.i32(), Float32(v).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def fma(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    """a * b + c, round to nearest, subnormal inputs kept (no .ftz)."""
    return Float32(_asm(T.f32(), [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip),
                                  Float32(c).ir_value(loc=loc, ip=ip)], "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f"))


@dsl_user_op
def ld_u64(addr: Int64, *, loc=None, ip=None) -> Int64:
    """A u64 from global memory through the read-only path (tables constant over a kernel)."""
    return Int64(_asm(T.i64(), [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.global.nc.u64 $0, [$1];", "=l,l"))


@dsl_user_op
def ld_relaxed_s32(addr: Int64, *, loc=None, ip=None) -> Int32:
    """An s32 from global memory, coherent at GPU scope (a value earlier kernels update)."""
    return Int32(_asm(T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.relaxed.gpu.global.s32 $0, [$1];",
                      "=r,l", side=True))


@dsl_user_op
def sts_bf16(addr: Int32, v: Float32, *, loc=None, ip=None) -> None:
    """v rounded to bf16, stored to shared memory."""
    _asm(None, [Int32(addr).ir_value(loc=loc, ip=ip), Float32(v).ir_value(loc=loc, ip=ip)],
         "{ .reg .b16 h; cvt.rn.bf16.f32 h, $1; st.shared.b16 [$0], h; }", "r,f", side=True)


@dsl_user_op
def st_v4(addr: Int64, a: Int32, b: Int32, c: Int32, d: Int32, *, loc=None, ip=None) -> None:
    """Four u32 words to a 16-byte aligned global address (this GPU's memory or a peer's over NVLink)."""
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip)] + [Int32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
         "st.global.v4.u32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", side=True)


@dsl_user_op
def fence_acq_rel_sys(*, loc=None, ip=None) -> None:
    """Order this thread's earlier memory operations before its later ones for every observer in
    the system (peer GPUs included)."""
    _asm(None, [], "fence.acq_rel.sys;", "~{memory}", side=True)


@dsl_user_op
def st_release_sys_u32(addr: Int64, v: Int32, *, loc=None, ip=None) -> None:
    """A release store at system scope: a peer that acquires this value sees what the CTA wrote
    before it (with a CTA barrier and fence before it)."""
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Int32(v).ir_value(loc=loc, ip=ip)],
         "st.release.sys.global.u32 [$0], $1;", "l,r", side=True)
