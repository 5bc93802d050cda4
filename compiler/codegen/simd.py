"""Vector helpers every kernel family uses, and which SIMD instructions a
target has for them.

What an emitter may use is a fact of the target it compiles for
(``KernelBuilder.target``), so the functions that name x86 intrinsics take
the target and return None where it lacks them: the caller then emits the
portable form (which LLVM turns into what the target does have).
"""
from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Sequence

import llvmlite.ir as ir

if TYPE_CHECKING:
    from .target import Target

I1 = ir.IntType(1)
I8 = ir.IntType(8)
I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
F32 = ir.FloatType()
HALF = ir.HalfType()


def vconst(t: ir.Type, values: Sequence) -> ir.Constant:
    """A constant vector of ``t`` holding ``values``: one object per distinct
    constant, shared by every instruction and module that uses it (a constant
    has no parent or users in llvmlite). Made anew, each of a K-quant prompt
    kernel's ~1,600 shuffle masks and splats built a Constant per lane and
    formatted them again in ``str(module)``: 40% of its compile time."""
    values = tuple(values)
    return _vconst(t, repr(values), values)


@lru_cache(maxsize=1 << 14)
def _vconst(t: ir.Type, key: str, values: tuple) -> ir.Constant:
    """Keyed by ``repr``: -0.0 == 0.0 and 1 == 1.0 == True as dict keys."""
    return ir.Constant(ir.VectorType(t, len(values)), list(values))


@lru_cache(maxsize=None)
def undef(t: ir.Type) -> ir.Constant:
    """``undef`` of type ``t``, one shared object per type; a vector's is the
    single word ``undef`` (llvmlite spells one lane by lane, and a prompt
    kernel's 2,400 splats and shuffles each formatted 16 of them)."""
    c = ir.Constant(t, ir.Undefined)
    c.constant = ir.Undefined
    return c


def shuffle(b: ir.IRBuilder, x: ir.Value, y: ir.Value | None, idx: Sequence[int]) -> ir.Value:
    """Lanes ``idx`` of x followed by y (y None: x alone)."""
    return b.shuffle_vector(x, y if y is not None else undef(x.type), vconst(I32, idx))


def concat(b: ir.IRBuilder, parts: list[ir.Value]) -> ir.Value:
    """Equal-width vectors (a power of two of them) joined into one."""
    while len(parts) > 1:
        n = parts[0].type.count
        parts = [shuffle(b, parts[i], parts[i + 1], list(range(2 * n))) for i in range(0, len(parts), 2)]
    return parts[0]


def pair_sums(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """Adjacent lanes of ``v`` summed (n lanes -> n/2)."""
    n = v.type.count
    return b.add(shuffle(b, v, None, list(range(0, n, 2))), shuffle(b, v, None, list(range(1, n, 2))))


def call(kb, name: str, ret: ir.Type, args: list[ir.Value]) -> ir.Value:
    """Call the intrinsic (or any function) ``name``, declared in the kernel's module once."""
    fn = kb.module.globals.get(name)
    if fn is None:
        fn = ir.Function(kb.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return kb.b.call(fn, args)


def gather_f16(kb, ptrs: list[ir.Value], off: int) -> ir.Value:
    """<n x float>: the float16 at byte ``off`` of each of the n pointers (i8*)."""
    b = kb.b
    v = undef(ir.VectorType(HALF, len(ptrs)))
    for i, bp in enumerate(ptrs):
        p = bp if off == 0 else kb.gep(bp, off)
        v = b.insert_element(v, b.load(b.bitcast(p, ir.PointerType(HALF)), align=1), ir.Constant(I64, i))
    return b.fpext(v, ir.VectorType(F32, len(ptrs)))


# --- which instructions a target has --------------------------------------------------------------
def _x86(t: "Target") -> bool:
    return t.triple.startswith("x86_64")


def dpbusd(t: "Target", groups: int) -> str | None:
    """The ``vpdpbusd`` intrinsic for 32 * groups bytes, if the target has it."""
    if not _x86(t):
        return None
    if groups == 2 and t.has("avx512vnni"):
        return "llvm.x86.avx512.vpdpbusd.512"
    if groups == 1 and ((t.has("avx512vnni") and t.has("avx512vl")) or t.has("avxvnni")):
        return "llvm.x86.avx512.vpdpbusd.256"
    return None


def madd(t: "Target", nbytes: int) -> tuple[str, str, str | None] | None:
    """(``pmaddubsw``, ``pmaddwd``, VNNI ``vpdpwssd`` or None) intrinsics for
    ``nbytes``-byte operands, if the target has them."""
    if not _x86(t):
        return None
    if nbytes == 64 and t.has("avx512bw"):
        dp = "llvm.x86.avx512.vpdpwssd.512" if t.has("avx512vnni") else None
        return "llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512", dp
    if nbytes == 32 and t.has("avx2"):
        vnni = (t.has("avx512vnni") and t.has("avx512vl")) or t.has("avxvnni")
        return "llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd", ("llvm.x86.avx512.vpdpwssd.256" if vnni else None)
    return None


def psadbw(t: "Target", groups: int) -> str | None:
    """The ``vpsadbw`` intrinsic for 32 * groups bytes, if the target has it."""
    if not _x86(t):
        return None
    if groups == 2 and t.has("avx512bw"):
        return "llvm.x86.avx512.psad.bw.512"
    if groups == 1 and t.has("avx2"):
        return "llvm.x86.avx2.psad.bw"
    return None


def permutes(t: "Target", vw: int) -> bool:
    """Whether 16-lane float permutes (``vpermps``, ``vpermi2ps``) exist: AVX-512 at width 16."""
    return vw == 16 and _x86(t) and t.has("avx512f")


def pshufb(t: "Target", nbytes: int) -> str | None:
    """The byte shuffle ``vpshufb`` intrinsic for ``nbytes``-byte operands (a
    16-byte table per 128-bit lane), if the target has it."""
    if not _x86(t):
        return None
    if nbytes == 64 and t.has("avx512bw"):
        return "llvm.x86.avx512.pshuf.b.512"
    if nbytes == 32 and t.has("avx2"):
        return "llvm.x86.avx2.pshuf.b"
    if nbytes == 16 and t.has("ssse3"):
        return "llvm.x86.ssse3.pshuf.b.128"
    return None


def lookup16(kb, table: Sequence[int], idx: ir.Value) -> ir.Value:
    """<n x i8>: ``table[idx]`` in each lane, for a 16-entry table of byte
    values and indices 0..15 (<n x i8>). A ``vpshufb`` per 16, 32 or 64
    bytes where the target has it (the widest it has; narrower vectors are
    padded to 16 lanes); else portable: a tree of 15 selects on the 4 index
    bits, which LLVM turns into blends."""
    b, n = kb.b, idx.type.count
    values = [v & 0xFF for v in table]
    assert len(values) == 16, table
    for width in (64, 32, 16):
        name = pshufb(kb.target, width)
        if name is None or (n < width and width > 16):
            continue
        if n < 16:   # pad to 16 lanes, look up, take the first n back
            wide = shuffle(b, idx, None, list(range(n)) + [0] * (16 - n))
            return shuffle(b, lookup16(kb, table, wide), None, list(range(n)))
        parts = [shuffle(b, idx, None, list(range(i, i + width))) for i in range(0, n, width)] if n > width else [idx]
        tab = vconst(I8, values * (width // 16))
        out = [call(kb, name, ir.VectorType(I8, width), [tab, p]) for p in parts]
        return concat(b, out) if len(out) > 1 else out[0]
    one = ir.Constant(idx.type, [1] * n)
    level = [vconst(I8, [v] * n) for v in values]
    for bit in range(4):      # pairs (2i, 2i + 1) picked by bit 0, then pairs of those by bit 1 ...
        set_ = b.icmp_unsigned("!=", b.and_(b.lshr(idx, ir.Constant(idx.type, [bit] * n)) if bit else idx, one),
                               ir.Constant(idx.type, [0] * n))
        level = [b.select(set_, level[i + 1], level[i]) for i in range(0, len(level), 2)]
    return level[0]
