"""Prompt chunks on the integer path as a register-blocked int8 GEMM (the
``gemm`` attribute, set by ``passes/int_dot`` on prompt graphs only).

The decode kernel (``matmul/int_q8``) puts 32 values of one weight row in a
vector's lanes: per (row, token, block group) one ``vpdpbusd`` and three
float instructions for 64 products, and a horizontal sum per output. Here
the lanes hold W output rows instead (W = 16 at vector width 16, 8 at 8),
as oneDNN's and llama.cpp's repacked VNNI GEMMs do:

1. Every thread quantizes up to ``gemm`` token rows into its scratch (the
   q8 numbers of ``ir.int_dot.quantize_q8_rows``; per block also the scalar
   -bias * sum(q_x), or d_x * sum(q_x) for the offset layouts, and d_x).
2. Per tile of W weight rows of its share and per chunk of ``KC`` blocks,
   the tile is unpacked once into scratch in VNNI order: per 32-value block
   8 vectors of [W rows x 4 consecutive values] unsigned bytes (the decode
   kernel's biased quants, transposed), W float scales (and W minimums).
3. Then all tokens, ``P`` at a time (the 8 weight vectors of a block stay in
   registers across them): per token and block, the int32 lanes start at
   the broadcast bias correction, take 8 ``vpdpbusd`` with 4 activation
   bytes broadcast, are converted to float and FMA'd into the token's
   accumulator with scale x d_x (offset layouts: one more FMA, m_w x
   d_x sum(q_x)). 12 instructions for 16 x 32 products.

Each token's accumulator is one FMA chain over all blocks in order,
continued across K chunks through the output row (stored, reloaded: exact),
so a token's result does not depend on T, its place in the chunk, P or KC:
chunked prefill and the prefix cache see the same bits for the same row.
The numbers are not the decode step's (no 8-lane split, no horizontal
sum), which graphs of decode rows (``batch_decode``, ``verify``) need: they
never carry the attribute. Float32 in another order than the reference's
float64: the integer tests' tolerance applies.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import llvmlite.ir as ir

from .. import amx
from ..act_quant import QK, quantize_q8_block
from ..emit import F32, I32, KernelBuilder, as_i64, i64
from ..kernels import KernelSig
from ..simd import I8, call, concat, shuffle, undef, vconst
from ..target import Target, vnni_width
from .amx_tiles import fill_panels
from .amx_tiles import chunk as amx_chunk
from .amx_tiles import layout as amx_layout
from .amx_tiles import usable as amx_usable
from .common import tuned

#: tokens per register block (each: an int32 and a float accumulator beside
#: a block's 8 weight vectors: 8 + 16 + scales fit the 32 AVX-512 registers)
_P = 8
#: blocks per K chunk: the unpacked tile (640 bytes a block at W = 16)
#: and P tokens' activations for the chunk stay in L1
_KC = 32


def use_gemm(sig: KernelSig, vw: int, target: Target | None = None) -> bool:
    """The GEMM runs for a [T, K] ``qmatmul`` marked ``gemm`` whose rows fill
    tiles of the target's VNNI width (``target.vnni_width``)."""
    if not sig.attr.get("gemm") or sig.attr.get("act") not in ("q8", "q8k") or len(sig.in_types[0].shape) < 2:
        return False
    w = vnni_width(vw, target)
    return w is not None and int(sig.in_types[1].shape[0]) % w == 0


def act_slot_bytes(k: int) -> int:
    """Scratch of one quantized token row: K quants, per block an int32 (or
    float32) correction and a float32 d_x, rounded up to a cache line."""
    return (k + 8 * (k // QK) + 63) // 64 * 64


def tile_block_bytes(w: int) -> int:
    """One unpacked block of a W-row tile: 8 vectors of W x 4 bytes, W
    scales, W minimums (offset layouts; reserved for all)."""
    return 8 * 4 * w + 8 * w


def scratch_bytes(sig: KernelSig) -> int:
    """Per-thread scratch of the q8 GEMM (at W = 16, an upper bound for 8),
    with its AMX path's (``amx_tiles.layout``)."""
    k = int(sig.in_types[1].shape[1])
    return amx_layout(_vnni_bytes(sig), int(sig.attr["gemm"]), act_slot_bytes(k), Q8Gemm.amx_panel_bytes * (k // QK))[2]


def _vnni_bytes(sig: KernelSig) -> int:
    k = int(sig.in_types[1].shape[1])
    kc = min(int(sig.attr.get("kc", _KC)), k // QK)
    return int(sig.attr["gemm"]) * act_slot_bytes(k) + kc * tile_block_bytes(16)


def transpose(b: ir.IRBuilder, rows: list[ir.Value]) -> list[ir.Value]:
    """W rows of <C x i32> -> C vectors of <W x i32> (vector i, lane r = rows[r][i]):
    rows j, j + C, ... joined into vector j, then log2 C butterfly stages
    exchanging a bit of the vector index with the same bit of the column."""
    w, c = len(rows), rows[0].type.count
    z = [concat(b, [rows[j + c * h] for h in range(w // c)]) for j in range(c)]
    bit = 1
    while bit < c:
        for j in range(c):
            if j & bit:
                continue
            lo = [l if not (l % c) & bit else w + l - bit for l in range(w)]
            hi = [l + bit if not (l % c) & bit else w + l for l in range(w)]
            z[j], z[j | bit] = shuffle(b, z[j], z[j | bit], lo), shuffle(b, z[j], z[j | bit], hi)
        bit *= 2
    return z


def amx_row(kb: KernelBuilder, sums: ir.Value, p: int) -> ir.Value:
    """Row p of an AMX product stored at i8* ``sums``: <16 x i32>."""
    return kb.vload(kb.b.bitcast(kb.gep(sums, amx.ROW_BYTES * p), ir.PointerType(I32)), 0, 16)


class GemmBase:
    """What the GEMM of every layout shares: token slots and the unpacked
    tile in scratch, broadcasts, and a register block of tokens against a
    K chunk (``tokens``). A layout supplies ``unit`` (values per block),
    ``slot_bytes``, ``block_bytes``, ``quantize``, ``unpack`` and ``block``."""

    unit = QK
    #: the AMX tiles take signed weight bytes (``Q8Gemm.amx_signed``)
    amx_signed = False
    #: int32 chains ``dots`` splits a block's ``vpdpbusd`` into
    chains = 1

    def __init__(self, kb: KernelBuilder, sig: KernelSig, kern, slot_bytes: int, block_bytes: int,
                 kc: int, width: int | None = None) -> None:
        self.kb, self.b, self.kern = kb, kb.b, kern
        self.attrs = sig.attr
        self.W = width or vnni_width(kb.vw, kb.target)
        self.k, self.nb = kern.k, kern.nb
        self.ts = int(sig.attr.get("gemm", 1))   # a repacked weight's kernel has no tile in scratch
        self.P = tuned(kb, sig.attr, "tokens", _P)
        self.kc = min(tuned(kb, sig.attr, "kc", kc), self.nb)
        self.slot_bytes, self.block_bytes = slot_bytes, block_bytes
        self.tile = kb.gep(kb.scratch, self.ts * slot_bytes)
        self.vf = ir.VectorType(F32, self.W)
        self.vi = ir.VectorType(I32, self.W)
        self.vnni = "llvm.x86.avx512.vpdpbusd.512" if self.W == 16 else "llvm.x86.avx512.vpdpbusd.256"
        #: the float rows ``quantize`` reads: x (input 0), or a row buffer a fused norm writes (``row_at``)
        self.x = kb.in_f32(0)
        self.prenorm: Callable[[ir.Value], None] | None = None

    def row_at(self, t: ir.Value) -> ir.Value:
        """Where token row t starts in ``self.x``; with a fused norm
        (``prenorm``), it first writes the row, normalized, to its buffer."""
        if self.prenorm is None:
            return self.b.mul(t, i64(self.k))
        self.prenorm(t)
        return i64(0)

    def slot(self, s: ir.Value) -> ir.Value:
        return self.kb.gep(self.kb.scratch, self.b.mul(s, i64(self.slot_bytes)))

    def block_source(self, r0: ir.Value, j: ir.Value, jj: ir.Value) -> ir.Value:
        """Where block j of the tile at row r0 is read from (the ``jj``-th of
        its K chunk): the unpacked tile in scratch (a repacked weight: the
        weight itself, ``matmul/repacked``)."""
        return self.tile_block(jj)

    def tile_block(self, jj: ir.Value) -> ir.Value:
        return self.kb.gep(self.tile, self.b.mul(jj, i64(self.block_bytes)))

    def bcast(self, p: ir.Value, t: ir.Type) -> ir.Value:
        """A 4-byte scalar at i8* p, broadcast to W lanes of type t."""
        b = self.b
        return self.kb.splat(b.load(b.bitcast(p, ir.PointerType(t)), align=1), self.W)

    def vec(self, p: ir.Value, at: int, t: ir.Type = F32) -> ir.Value:
        """W lanes of type t at byte ``at`` of i8* p."""
        return self.kb.vload(self.b.bitcast(self.kb.gep(p, at), ir.PointerType(t)), 0, self.W)

    def dots(self, a: ir.Value, ws: list[ir.Value], q: ir.Value) -> ir.Value:
        """a + the weight vectors ws times the activation quants at i8* q,
        4 bytes broadcast per vector, in ``chains`` int32 chains added at the
        end (integer sums: the same numbers in any order)."""
        kb, b = self.kb, self.b
        v8 = ir.VectorType(I8, 4 * self.W)
        chains = [a] + [ir.Constant(self.vi, [0] * self.W)] * (min(self.chains, len(ws)) - 1)
        for i, w in enumerate(ws):
            c = i % len(chains)
            chains[c] = call(kb, self.vnni, self.vi, [chains[c], w, b.bitcast(self.bcast(kb.gep(q, 4 * i), I32), v8)])
        a = chains[0]
        for c in chains[1:]:
            a = b.add(a, c)
        return a

    def tokens(self, r0: ir.Value, c0: int | ir.Value, nblk: int | ir.Value, s0: ir.Value, t0: ir.Value, P: int) -> None:
        """Tokens in slots s0 .. s0+P-1 (token rows t0 + slot) against the
        unpacked blocks c0 .. c0+nblk-1 of the tile at r0: each token's
        accumulator continues the chain from the output row (zero at block 0,
        also where c0 is a run-time value)."""
        kb, b, kern, W = self.kb, self.b, self.kern, self.W
        outs = [kb.gep(kern.out, b.add(b.mul(b.add(t0, b.add(s0, i64(p))), i64(kern.n_out)), r0)) for p in range(P)]
        slots = [self.slot(b.add(s0, i64(p))) for p in range(P)]
        zero = ir.Constant(self.vf, [0.0] * W)
        if isinstance(c0, int):
            accs = [zero] * P if c0 == 0 else [kb.vload(o, 0, W) for o in outs]
        else:   # the output row's bytes are read at block 0 too, and not used
            first = b.icmp_signed("==", c0, i64(0))
            accs = [b.select(first, zero, kb.vload(o, 0, W)) for o in outs]
        with kb.loop_carry(0, nblk, accs, name="gb") as (jj, cur, setv):
            j = b.add(jj, as_i64(c0))
            setv(self.block(j, self.block_source(r0, j, jj), slots, list(cur)))
        for o, v in zip(outs, kb.last_carry):
            kb.vstore(v, o, 0)

    @contextlib.contextmanager
    def quantized_rows(self, m: ir.Value, ts: int):
        """A loop over the m token rows, ``ts`` at a time: each group (t0, n)
        quantized into the slots, then the body."""
        kb, b = self.kb, self.b
        with kb.loop(0, m, step=ts, name="gts") as t0:
            left = b.sub(m, t0)
            n = b.select(b.icmp_signed("<", left, i64(ts)), left, i64(ts))
            with kb.loop(0, n, name="gquant") as s:
                self.quantize(self.row_at(b.add(t0, s)), s)
            yield t0, n

    def every_token(self, r0: ir.Value, c0: int | ir.Value, nblk: int | ir.Value, n: ir.Value, t0: ir.Value,
                    P: int, start: int | ir.Value = 0) -> None:
        """``tokens`` for slots start .. n-1: P at a time, the rest in blocks of
        the powers of two below P."""
        kb, b = self.kb, self.b
        rest = b.srem(b.sub(n, as_i64(start)), i64(P))
        n_main = b.sub(n, rest)
        with kb.loop(start, n_main, step=P, name="gtok") as s0:
            self.tokens(r0, c0, nblk, s0, t0, P)
        q = 1 << max(0, (P - 1).bit_length() - 1)
        while q >= 1 and P > 1:
            with kb.if_then(b.icmp_signed("!=", b.and_(rest, i64(q)), i64(0))):
                self.tokens(r0, c0, nblk, b.add(n_main, b.and_(rest, i64(-2 * q))), t0, q)
            q //= 2

    def k_chunks(self, r0: ir.Value, kc: int, chunk) -> None:
        """chunk(r0, c0, nblk) over the tile's blocks, kc at a time, in one
        run-time loop (the last chunk may be short): one copy of the tile code
        however long K (LLVM's time and memory grow with the copies: Qwen's
        K=4864 Q6_K GEMM took 6.9 s and 180 MB with one copy per chunk)."""
        kb, b, nb = self.kb, self.b, self.nb
        if nb <= kc:
            chunk(r0, 0, nb)
            return
        with kb.loop(0, nb, step=kc, name="gkc") as c0:
            left = b.sub(i64(nb), c0)
            chunk(r0, c0, b.select(b.icmp_signed("<", left, i64(kc)), left, i64(kc)))


class Q8Gemm(GemmBase):
    """The 32-value block layouts (Q8_0, Q4_0, Q5_0, Q4_1, Q5_1; QSF's
    64-value blocks as two of them, the kernel's ``unsigned_block`` and
    ``block_scales``): scratch,
    quantization, unpacking into VNNI order with the decode kernel's
    biases, and the microkernel."""

    #: a token's 8 ``vpdpbusd`` of a block in one chain are 8 dependent instructions before its
    #: convert and FMA (LLVM gives every token of the register block one register: only out-of-
    #: order execution overlaps them). Two chains, Q4_1 [1536 x 576] x 128 tokens, Zen 4, kernel
    #: lab medians (us), alternated: 2 threads 430-483 -> 408-420, 1 thread 757-837 -> 735-791.
    #: The K-quants' sub-blocks keep one (no gain above this machine's noise)
    chains = 2

    def __init__(self, kb: KernelBuilder, sig: KernelSig, kern) -> None:
        super().__init__(kb, sig, kern, act_slot_bytes(kern.k), tile_block_bytes(vnni_width(kb.vw, kb.target)), _KC)

    def _gather(self, ptrs: list[ir.Value], off: int, t: ir.Type) -> ir.Value:
        """<W x t>: the scalar at byte ``off`` of each row's block."""
        b = self.b
        v = undef(ir.VectorType(t, len(ptrs)))
        for r, p in enumerate(ptrs):
            q = b.bitcast(self.kb.gep(p, off), ir.PointerType(t))
            v = b.insert_element(v, b.load(q, align=1), i64(r))
        return v

    def unpack(self, r0: ir.Value, j: ir.Value, dst: ir.Value, signed: bool = False) -> None:
        """Block j of rows r0 .. r0+W-1 into ``dst`` (i8*): 8 vectors of
        <4W x i8>, then W float32 scales d_w, then W minimums m_w
        (``signed``: the quants without their bias, ``amx_signed``)."""
        kern, kb, b, W = self.kern, self.kb, self.b, self.W
        ptrs = [kern.block_ptr(b.add(r0, i64(r)), j) for r in range(W)]
        qt = kern.qt
        v4w = ir.VectorType(I8, 4 * W)
        # nibble types: the tile comes from transposed nibble bytes (fewer shuffles than
        # transposing each row's 32 unpacked bytes, as Q8_0 and QSF's do)
        if not kern.nibble_tiles:   # Q8_0, QSF, table types: the decode kernel's unsigned bytes, transposed
            rows = [b.bitcast(kern.unsigned_block(p, j), ir.VectorType(I32, 8)) for p in ptrs]
            vecs = [b.bitcast(v, v4w) for v in transpose(b, rows)]
        else:
            rows = [b.bitcast(kb.vload(p, qt.at("qs"), 16), ir.VectorType(I32, 4)) for p in ptrs]
            cols = [b.bitcast(v, v4w) for v in transpose(b, rows)]
            lo = [b.and_(v, vconst(I8, [0x0F] * 4 * W)) for v in cols]
            hi = [b.lshr(v, vconst(I8, [4] * 4 * W)) for v in cols]
            vecs = lo + hi
            if qt.has("qh"):
                h = self._gather(ptrs, qt.at("qh"), I32)
                vecs = [b.or_(v, self._high_bits(h, i)) for i, v in enumerate(vecs)]
        for i, v in enumerate(self.signed_bytes(vecs) if signed else vecs):
            kb.vstore(v, dst, 4 * W * i)
        f = ir.PointerType(F32)
        dw, mw = kern.block_scales(ptrs, [j] * W)
        kb.vstore(dw, b.bitcast(kb.gep(dst, 32 * W), f), 0)
        if mw is not None:
            kb.vstore(mw, b.bitcast(kb.gep(dst, 36 * W), f), 0)

    def _high_bits(self, h: ir.Value, i: int) -> ir.Value:
        """<4W x i8>: 16 in byte c of lane r where bit 4i + c of row r's qh is set
        (the 4 bits spread to bytes by one multiply: no carries)."""
        b, W = self.b, self.W
        c = lambda x: vconst(I32, [x] * W)  # noqa: E731
        nib = b.and_(b.lshr(h, c(4 * i)), c(0xF)) if i else b.and_(h, c(0xF))
        spread = b.and_(b.mul(b.shl(nib, c(4)), c(0x00204081)), c(0x10101010))
        return b.bitcast(spread, ir.VectorType(I8, 4 * W))

    def quantize(self, xrow: ir.Value, s: ir.Value) -> None:
        """Token row x[xrow / K] into slot s: quants, then per block the
        int32 seed -bias * sum(q_x) (offset layouts: float32 d_x sum(q_x)), then d_x."""
        kb, b, kern = self.kb, self.b, self.kern
        sp = self.slot(s)
        cor = b.bitcast(kb.gep(sp, self.k), ir.PointerType(I32))
        dxp = b.bitcast(kb.gep(sp, self.k + 4 * self.nb), ir.PointerType(F32))
        with kb.loop(0, self.nb, name="gq") as j:
            q, d, sx = quantize_q8_block(kb, b.add(xrow, b.mul(j, i64(QK))), self.x)
            kb.vstore(q, sp, b.mul(j, i64(QK)))
            if kern.offset:   # exact in float32, as the decode kernel's
                kb.store(b.bitcast(b.fmul(d, b.sitofp(sx, F32)), I32), cor, j)
            else:
                kb.store(b.mul(sx, ir.Constant(I32, -kern.bias)), cor, j)
            kb.store(d, dxp, j)

    def weights(self, tb: ir.Value) -> tuple[list[ir.Value], ir.Value, ir.Value | None]:
        """The unpacked block at tb: 8 weight vectors <4W x i8>, the W scales
        d_w and (offset layouts) the W minimums m_w, as float32."""
        kb, W = self.kb, self.W
        ws = [kb.vload(tb, 4 * W * i, 4 * W) for i in range(8)]
        return ws, *self.unpacked_scales(tb)

    def unpacked_scales(self, tb: ir.Value) -> tuple[ir.Value, ir.Value | None]:
        """d_w and (offset layouts) m_w of the unpacked block at tb."""
        W = self.W
        return self.vec(tb, 32 * W), self.vec(tb, 36 * W) if self.kern.offset else None

    def block(self, j: ir.Value, tb: ir.Value, slots: list[ir.Value], accs: list[ir.Value]) -> list[ir.Value]:
        """Block j (unpacked at tb) into every slot's accumulator: 8 weight
        vectors loaded once, per token 8 ``vpdpbusd``, convert, FMA."""
        kb, b, kern, W = self.kb, self.b, self.kern, self.W
        ws, sc, mw = self.weights(tb)
        new = []
        for sp, acc in zip(slots, accs):
            a = ir.Constant(self.vi, [0] * W) if kern.offset else self.bcast(self._cor(sp, j), I32)
            a = self.dots(a, ws, kb.gep(sp, b.mul(j, i64(QK))))
            new.append(self._scaled(a, sp, j, sc, mw, acc))
        return new

    def _cor(self, sp: ir.Value, j: ir.Value) -> ir.Value:
        """Block j's correction in slot sp (the int32 seed, or d_x sum(q_x))."""
        return self.kb.gep(sp, self.b.add(i64(self.k), self.b.mul(j, i64(4))))

    def _scaled(self, a: ir.Value, sp: ir.Value, j: ir.Value, sc: ir.Value, mw: ir.Value | None,
                acc: ir.Value) -> ir.Value:
        """acc + block j's int32 sums ``a`` (seeded) times d_w d_x (offset layouts:
        plus m_w d_x sum(q_x)): the one float chain every kernel of a token shares."""
        kb, b = self.kb, self.b
        dx = self.bcast(kb.gep(sp, b.add(i64(self.k + 4 * self.nb), b.mul(j, i64(4)))), F32)
        acc = kb.fma(b.sitofp(a, self.vf), b.fmul(sc, dx), acc)
        if mw is not None:
            acc = kb.fma(mw, self.bcast(self._cor(sp, j), F32), acc)
        return acc

    # --- AMX tiles (``matmul/amx_tiles``) --------------------------------------------------
    @property
    def amx_signed(self) -> bool:
        """The tiles take the weights' signed quants (``tdpbssd``) instead of
        the biased unsigned ones with the int32 seed -bias * sum(q_x): the
        same integer sums (sum q_x (w + bias) - bias sum q_x = sum q_x w,
        exact), one broadcast and add less per token row and block in the
        epilogue. The symmetric layouts with a bias, whose quants w are int8."""
        return not self.kern.offset and self.kern.bias > 0

    def signed_bytes(self, vecs: list[ir.Value]) -> list[ir.Value]:
        """The biased unsigned weight vectors (<4W x i8>) as signed quants (minus the bias, wrapping)."""
        bias = vconst(I8, [self.kern.bias - 256 if self.kern.bias > 127 else self.kern.bias] * 4 * self.W)
        return [self.b.sub(v, bias) for v in vecs]

    #: bytes of one block's int32 sums; blocks a loop step takes (their products
    #: two at a time); blocks a product runs ahead of its epilogue; bytes of a
    #: block's panel entry (16 tokens' d_x, then their corrections)
    amx_sums_bytes = amx.ROWS * amx.ROW_BYTES
    amx_step = 2
    amx_ahead = 2
    amx_panel_bytes = 2 * 4 * amx.ROWS

    def amx_fill_panel(self, slots: list[ir.Value], panel: ir.Value) -> None:
        """16 token slots' d_x and corrections of every block, side by side
        per block (the epilogue broadcasts them from one base pointer)."""
        kb, b = self.kb, self.b
        with kb.loop(0, self.nb, name="apanel") as j:
            pj = kb.gep(panel, b.mul(j, i64(self.amx_panel_bytes)))
            for p, sp in enumerate(slots):
                dx = kb.gep(sp, b.add(i64(self.k + 4 * self.nb), b.mul(j, i64(4))))
                for src, at in ((dx, 4 * p), (self._cor(sp, j), 4 * amx.ROWS + 4 * p)):
                    v = b.load(b.bitcast(src, ir.PointerType(I32)), align=4)
                    b.store(v, b.bitcast(kb.gep(pj, at), ir.PointerType(I32)), align=4)

    def amx_products(self, j: ir.Value, tb: ir.Value, a0: ir.Value, sums: ir.Value) -> list[amx.Product]:
        """Block j: one ``tdpbsud`` of 16 token slots' 32 quants (A rows from
        slot a0 on) by the block's 8 weight vectors as they lie at tb (B),
        the 16 x 16 int32 sums stored at ``sums``."""
        return [amx.Product(amx.ROWS, QK, self.kb.gep(a0, self.b.mul(j, i64(QK))), self.slot_bytes, tb, sums,
                            signed=self.amx_signed)]

    def amx_epilogue(self, tb: ir.Value, pj: ir.Value, accs: list[ir.Value], sums: ir.Value) -> list[ir.Value]:
        """Each token's row of a block's sums, seeded and scaled as ``block``
        does (d_x and the correction from the block's panel entry pj): the
        same integers, the same float operations, the same bits."""
        kb, b = self.kb, self.b
        sc, mw = self.unpacked_scales(tb)
        new = []
        for p, acc in enumerate(accs):
            a = amx_row(kb, sums, p)
            cor = kb.gep(pj, 4 * amx.ROWS + 4 * p)
            if not self.kern.offset and not self.amx_signed:
                a = b.add(self.bcast(cor, I32), a)
            dx = self.bcast(kb.gep(pj, 4 * p), F32)
            acc = kb.fma(b.sitofp(a, self.vf), b.fmul(sc, dx), acc)
            if mw is not None:
                acc = kb.fma(mw, self.bcast(cor, F32), acc)
            new.append(acc)
        return new


def emit_int_gemm(kb: KernelBuilder, sig: KernelSig, kern, gemm: type, amx_faster: bool = False) -> None:
    """Per ``gemm`` tokens: quantize them; per tile of this thread's rows
    and K chunk: unpack the tile once, then every token, P at a time (the
    rest in blocks of the powers of two below P), or on AMX tiles 16 at a
    time from ``amx_tiles.MIN_TOKENS`` tokens on. ``gemm``: the weight
    type's GEMM class (``Q8Gemm``, ``gemm_kquants.KQGemm``)."""
    g = gemm(kb, sig, kern)
    b, W, P = kb.b, g.W, g.P
    lo, hi = kb.thread_share(kern.n // W)
    m = kb.rows_of(kern.xt.shape)
    on_tiles = amx_usable(kb, W, sig, amx_faster)
    with g.quantized_rows(m, g.ts) as (t0, n):
        def unpack(r0: ir.Value, c0: int | ir.Value, nblk: int | ir.Value) -> None:
            """Unpack blocks c0 .. c0 + nblk - 1 of the tile at r0 into scratch."""
            with kb.loop(0, nblk, name="gunpack") as jj:
                g.unpack(r0, b.add(jj, as_i64(c0)), g.tile_block(jj))

        def stage(r0: ir.Value, c0: int | ir.Value, nblk: int | ir.Value) -> None:
            """``unpack`` for the tiles (their signed quants where ``amx_signed``)."""
            with kb.loop(0, nblk, name="gstage") as jj:
                j = b.add(jj, as_i64(c0))
                if g.amx_signed:
                    g.unpack(r0, j, g.tile_block(jj), signed=True)
                else:
                    g.unpack(r0, j, g.tile_block(jj))

        def vnni(r0: ir.Value, c0: int | ir.Value, nblk: int | ir.Value) -> None:
            unpack(r0, c0, nblk)
            g.every_token(r0, c0, nblk, n, t0, P)

        def tiles(chunk) -> None:
            with kb.loop(lo, hi, name="gtile") as tile:
                g.k_chunks(b.mul(tile, i64(W)), g.kc, chunk)

        if not on_tiles:
            tiles(vnni)
        else:
            po, so, _ = amx_layout(g.ts * g.slot_bytes + g.kc * g.block_bytes, g.ts, g.slot_bytes,
                                   g.amx_panel_bytes * g.nb)
            panel, sums = kb.gep(kb.scratch, po), kb.gep(kb.scratch, so)
            fill_panels(g, n, panel)

            def rest(r0: ir.Value, c0: int | ir.Value, nblk: int | ir.Value, s0: ir.Value,
                     staged: ir.Value) -> None:
                """The VNNI code from slot s0 on, on the tile unpacked: the tiles' staging
                already is that, unless it holds signed quants or did not run."""
                if g.amx_signed:
                    unpack(r0, c0, nblk)
                else:
                    with kb.if_then(b.not_(staged)):
                        unpack(r0, c0, nblk)
                g.every_token(r0, c0, nblk, n, t0, P, s0)
            tiles(amx_chunk(g, stage, n, t0, panel, sums, rest))
    if on_tiles:
        amx.tile_release(kb)   # at the end: LLVM configures the tiles once, on entry
