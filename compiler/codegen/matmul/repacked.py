"""``qmatmul`` on a repacked weight (``ir/quant/repack.py``): the integer
GEMM of ``matmul/gemm`` reading its weight vectors straight from the
weight, which the runtime put in VNNI order once at load.

Every row count takes this kernel: a decode step (x [K]), a prompt chunk, a
batch of decode rows, a speculative check. Per token the accumulator is one
FMA chain over the blocks in order (the GEMM's, see its docstring), so a
row's result does not depend on how many rows share the call or where it
sits among them: decode, prefill, batched and verify rows agree bit for
bit, and with the GEMM on the file's layout too (same operations, the
weights decoded from the repacked bytes instead of the unpacked tile).

Per call (one thread): quantize up to ``TOKENS`` token rows into its
scratch (every thread all of them, as the GEMM), then per tile of W rows of
its share and per K chunk of blocks, every token ``P`` at a time. A tile's
blocks are contiguous and the tiles of a thread's share follow each other:
the weights are one sequential stream per thread, read once per step in a
decode, with a software prefetch ahead of it (into L1 for a decode step, L2
for several rows).

Per block the weight vectors come out of the repacked bytes with a few
instructions: Q8_0 as they are; Q4 nibble pairs by an AND and a shift (4
loads give the 8 vectors); Q5's fifth bits from a 4W-bit mask per vector
(``select`` of 16 or 0 on the mask bits); the K-quants likewise per
sub-block, their factors d sc_s and -dmin m_s as the products of a W-byte
load of the integer scales (exact in float32, so the GEMM's bits).
"""
from __future__ import annotations

import dataclasses

import llvmlite.ir as ir

from ir.quant import quant_type, repacked_layout
from ir.types import TensorType

from ..emit import F32, I32, KernelBuilder, as_i64, i64
from ..k_norm_rope import emit_rmsnorm_row, weight_loader
from ..kernels import KernelSig
from ..simd import HALF, I1, I8, vconst
from .amx_tiles import fill_panels
from .amx_tiles import chunk as amx_chunk
from .amx_tiles import layout as amx_layout
from .amx_tiles import usable as amx_usable
from .common import PREFETCH_BYTES, tuned
from .. import amx
from .gemm import GemmBase, Q8Gemm, act_slot_bytes as q8_slot_bytes, tile_block_bytes as q8_tile_block_bytes
from .gemm_kquants import KQGemm, act_slot_bytes as q8k_slot_bytes, amx_panel_bytes as kq_panel_bytes
from .gemm_kquants import block_bytes as kq_block_bytes
from .int_q8 import IntKernel
#: token rows quantized at once (scratch: a slot each)
TOKENS = 64
#: how far ahead of the weight stream a call on several token rows asks
#: for it (a decode step: ``PREFETCH_BYTES``, into L1). Into L2: a batch of
#: 8 decode rows of Qwen2.5-Coder-0.5B (lmc kernel, 2 threads, cold
#: weights) took 388 -> 129 us on the Q4_K ffn_down, 353 -> 195 on Q6_K,
#: 5.2 -> 5.0 ms on the Q8_0 output, Q5_0 unchanged, prompt chunks
#: unchanged; the whole batch step 26-29 -> 21-22 ms. Prefetched into L1, a
#: K-quant super-block's 37-53 lines at once were slower than none at all.
ROWS_PREFETCH_BYTES = 4096
#: blocks per K chunk of prompt rows (q8, q8k): the P tokens' activations
#: for a chunk stay in L1 while the tile's blocks stream through
KC = {"q8": 32, "q8k": 4}


def _base_sig(sig: KernelSig) -> tuple[KernelSig, str, int]:
    """The signature with the file's layout (the decode kernel classes
    read it), the base layout and the tile width."""
    wt = sig.in_types[1]
    types = (sig.in_types[0], dataclasses.replace(wt, repack=None), *sig.in_types[2:])
    return KernelSig(sig.op, types, sig.out_type, sig.attrs), wt.layout, wt.repack


def tokens_per_call(sig: KernelSig) -> int:
    """Token rows quantized at once: 1 for a decode step, else ``TOKENS``."""
    return 1 if len(sig.in_types[0].shape) < 2 else TOKENS


def _slots_bytes(sig: KernelSig) -> int:
    """A quantized activation slot per token row at once (cache lines each)."""
    k = int(sig.in_types[1].shape[1])
    per = q8k_slot_bytes(k) if sig.attr.get("act") == "q8k" else q8_slot_bytes(k)
    return tokens_per_call(sig) * per


def _vnni_bytes(sig: KernelSig) -> int:
    """The slots, and with a fused RMSNorm the row it normalizes."""
    k = int(sig.in_types[1].shape[1])
    return _slots_bytes(sig) + (4 * k if "norm_eps" in sig.attr else 0)


def _staged_block_bytes(sig: KernelSig) -> int:
    """One block of the tile as the AMX path stages it (the GEMM's unpacked form, W = 16)."""
    base = sig.in_types[1].layout
    return kq_block_bytes(16, base) if sig.attr.get("act") == "q8k" else q8_tile_block_bytes(16)


def _kc(sig: KernelSig) -> int:
    k = int(sig.in_types[1].shape[1])
    act = sig.attr.get("act", "q8")
    return min(int(sig.attr.get("kc", KC[act])), k // (256 if act == "q8k" else 32))


def _amx_layout(sig: KernelSig) -> tuple[int, int, int]:
    """(staged tile, panel, sums) offsets of the AMX path's scratch after the
    VNNI kernel's, and the total (``amx_tiles.layout``)."""
    k = int(sig.in_types[1].shape[1])
    q8k = sig.attr.get("act") == "q8k"
    nb = k // (256 if q8k else 32)
    panel_bytes = (kq_panel_bytes(sig.in_types[1].layout) if q8k else Q8Gemm.amx_panel_bytes) * nb
    tile = _vnni_bytes(sig)
    return (tile, *amx_layout(tile + _kc(sig) * _staged_block_bytes(sig), TOKENS, _slots_bytes(sig) // TOKENS,
                                    panel_bytes))


def scratch_bytes(sig: KernelSig) -> int:
    """Per-thread scratch: the slots, with a fused RMSNorm the row it
    normalizes; for several rows, also the AMX path's staged tile, panel
    and sums (``amx_tiles``)."""
    if tokens_per_call(sig) == 1:
        return _vnni_bytes(sig)
    return _amx_layout(sig)[3]


def _fuse_norm(kb: KernelBuilder, g: GemmBase, sig: KernelSig) -> None:
    """``norm_eps`` (``passes/fuse_norm``): each token row is normalized into
    a row buffer after the slots just before it is quantized, by the
    rmsnorm kernel's own code, so the quantized values are the ones the two
    ops gave. Every thread normalizes the rows it quantizes (all of them):
    no barrier, and a row is a few hundred nanoseconds."""
    k, b = g.k, kb.b
    buf = kb.fptr(kb.gep(kb.scratch, _slots_bytes(sig)))
    last = len(sig.in_types) - 1
    wload = weight_loader(kb, sig.in_types[last], kb.in_raw[last])
    eps = float(sig.attr["norm_eps"])
    x = kb.in_f32(0)
    g.x = buf
    g.prenorm = lambda t: emit_rmsnorm_row(kb, kb.gep(x, b.mul(t, i64(k))), buf, wload, k, eps)


class _Repacked:
    """What the 32-value and K-quant repacked kernels share: the weight
    pointer of a tile block, W-lane loads of float16 and byte fields."""

    def _setup(self, base: str, width: int, sig: KernelSig) -> None:
        self.tb_bytes = repacked_layout(base, width).tile_block_bytes
        self.base = base
        # the AMX path's staged tile (``stage``), panel and sums, after the slots and the norm's row
        if tokens_per_call(sig) > 1:
            tile, panel, sums, _ = _amx_layout(sig)
            self.tile, self.panel, self.sums = (self.kb.gep(self.kb.scratch, at) for at in (tile, panel, sums))
            self.block_bytes = _staged_block_bytes(sig)
        one = len(sig.in_types[0].shape) < 2
        self.ahead = int(sig.attr.get("prefetch", PREFETCH_BYTES if one else ROWS_PREFETCH_BYTES))
        # a decode step keeps prefetching into L1: into L2 it measured 4-14% slower
        # (Qwen, medians of 15 and 21 alternated runs: 11.18 -> 12.79, 12.76 -> 13.36 ms)
        self.locality = 3 if one else 2

    def block(self, j: ir.Value, tb: ir.Value, slots: list[ir.Value], accs: list[ir.Value]) -> list[ir.Value]:
        """The layout's ``block``, after asking for the weight stream ``ahead`` bytes on."""
        if self.ahead:
            self.kb.prefetch(self.kb.gep(tb, self.ahead), self.tb_bytes, locality=self.locality)
        return super().block(j, tb, slots, accs)

    def stage(self, r0: ir.Value, c0: int | ir.Value, nblk: int | ir.Value) -> None:
        """Blocks c0 .. c0+nblk-1 of the tile at r0, decoded into scratch in
        the GEMM's unpacked form (AMX's B operand, the scales as float32)."""
        kb, b = self.kb, self.b
        with kb.loop(0, nblk, name="astage") as jj:
            j = b.add(jj, as_i64(c0))
            src = self.block_source(r0, j, jj)
            if self.ahead:
                kb.prefetch(kb.gep(src, self.ahead), self.tb_bytes, locality=self.locality)
            self.stage_block(src, self.tile_block(jj))

    def store_f32(self, v: ir.Value, dst: ir.Value, at: int) -> None:
        self.kb.vstore(v, self.b.bitcast(self.kb.gep(dst, at), ir.PointerType(F32)), 0)

    def block_source(self, r0: ir.Value, j: ir.Value, jj: ir.Value) -> ir.Value:
        b, W = self.b, self.W
        tile = b.sdiv(r0, i64(W))
        return self.kb.gep(self.kern.w, b.mul(b.add(b.mul(tile, i64(self.nb)), j), i64(self.tb_bytes)))

    def f16_lanes(self, tb: ir.Value, at: int) -> ir.Value:
        """W float16 at byte ``at`` of the tile block, as float32."""
        b, W = self.b, self.W
        p = b.bitcast(self.kb.gep(tb, at), ir.PointerType(ir.VectorType(HALF, W)))
        return b.fpext(b.load(p, align=1), ir.VectorType(F32, W))

    def byte_lanes(self, tb: ir.Value, at: int, signed: bool) -> ir.Value:
        """W bytes at byte ``at`` of the tile block, as float32 (exact)."""
        b, W = self.b, self.W
        p = b.bitcast(self.kb.gep(tb, at), ir.PointerType(ir.VectorType(I8, W)))
        v = b.load(p, align=1)
        return b.sitofp(b.sext(v, ir.VectorType(I32, W)) if signed else b.zext(v, ir.VectorType(I32, W)),
                        ir.VectorType(F32, W))

    def nibble_pairs(self, tb: ir.Value, at: int) -> tuple[ir.Value, ir.Value]:
        """The 4W-byte vector at ``at`` split into its low and high nibbles."""
        kb, b, W = self.kb, self.b, self.W
        v = kb.vload(kb.gep(tb, at), 0, 4 * W)
        return b.and_(v, vconst(I8, [0x0F] * 4 * W)), b.lshr(v, vconst(I8, [4] * 4 * W))

    def with_bits(self, v: ir.Value, tb: ir.Value, at: int, value: int) -> ir.Value:
        """v with ``value`` or'ed into the bytes whose bit is set in the 4W-bit mask at ``at``."""
        b, W = self.b, self.W
        it = ir.IntType(4 * W)
        bits = b.load(b.bitcast(self.kb.gep(tb, at), ir.PointerType(it)), align=1)
        hit = b.bitcast(bits, ir.VectorType(I1, 4 * W))
        return b.or_(v, b.select(hit, vconst(I8, [value] * 4 * W), vconst(I8, [0] * 4 * W)))


class RepackedQ8(_Repacked, Q8Gemm):
    """Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 repacked: the GEMM's ``block`` on weight
    vectors decoded from the repacked block."""

    def __init__(self, kb: KernelBuilder, sig: KernelSig, kern: IntKernel, base: str, width: int) -> None:
        GemmBase.__init__(self, kb, sig, kern, q8_slot_bytes(kern.k), 0, KC["q8"], width=width)
        self._setup(base, width, sig)

    def weights(self, tb: ir.Value) -> tuple[list[ir.Value], ir.Value, ir.Value | None]:
        kb, W, base = self.kb, self.W, self.base
        if base == "Q8_0":
            return [kb.vload(tb, 4 * W * i, 4 * W) for i in range(8)], self.f16_lanes(tb, 32 * W), None
        pairs = [self.nibble_pairs(tb, 4 * W * v) for v in range(4)]
        ws = [lo for lo, _ in pairs] + [hi for _, hi in pairs]
        at = 16 * W
        if base in ("Q5_0", "Q5_1"):
            ws = [self.with_bits(w, tb, at + W // 2 * i, 16) for i, w in enumerate(ws)]
            at += 4 * W
        mw = self.f16_lanes(tb, at + 2 * W) if base in ("Q4_1", "Q5_1") else None
        return ws, self.f16_lanes(tb, at), mw


    def stage_block(self, src: ir.Value, dst: ir.Value) -> None:
        W = self.W
        ws, sc, mw = self.weights(src)
        if self.amx_signed:
            ws = self.signed_bytes(ws)
        for i, w in enumerate(ws):
            self.kb.vstore(w, dst, 4 * W * i)
        self.store_f32(sc, dst, 32 * W)
        if mw is not None:
            self.store_f32(mw, dst, 36 * W)


class RepackedKQ(_Repacked, KQGemm):
    """Q4_K, Q5_K and Q6_K repacked: the K-quant GEMM's ``block`` on sub-block
    weight vectors and factors decoded from the repacked super-block."""

    def __init__(self, kb: KernelBuilder, sig: KernelSig, kern, base: str, width: int) -> None:
        KQGemm.__init__(self, kb, sig, kern, width=width)
        self.kc = min(tuned(kb, sig.attr, "kc", KC["q8k"]), self.nb)
        self._setup(base, width, sig)

    def _run_vector(self, tb: ir.Value, run: int, i: int) -> ir.Value:
        """Vector i (values 4i .. 4i + 3 of each row) of run ``run`` (32 values)."""
        W = self.W
        g, h = divmod(run, 2)
        group = 20 * W + 48 * W * g if self.base == "Q6_K" else 32 * W * g
        lo, hi = self.nibble_pairs(tb, group + 4 * W * i)
        v = hi if h else lo
        if self.base == "Q5_K":   # the fifth bits: mask (run, i)
            v = self.with_bits(v, tb, 128 * W + W // 2 * (8 * run + i), 16)
        if self.base == "Q6_K":   # bits 4, 5 from the group's high vector k, bits 2t: vector 4k + t = 8h + i
            b = self.b
            k, t = divmod(8 * h + i, 4)
            hv = self.kb.vload(self.kb.gep(tb, group + 32 * W + 4 * W * k), 0, 4 * W)
            top = b.and_(b.lshr(hv, vconst(I8, [2 * t] * 4 * W)), vconst(I8, [3] * 4 * W))
            v = b.or_(v, b.shl(top, vconst(I8, [4] * 4 * W)))
        return v

    def sub_weights(self, tb: ir.Value, s: int) -> tuple[list[ir.Value], ir.Value, ir.Value | None]:
        b, W = self.b, self.W
        if self.base in ("Q4_K", "Q5_K"):      # sub-blocks of 32: sub-block s is run s
            at = 128 * W if self.base == "Q4_K" else 160 * W       # d, dmin, sc, m after the quants
            ws = [self._run_vector(tb, s, i) for i in range(8)]
            scv = b.fmul(self.byte_lanes(tb, at + 4 * W + W * s, False), self.f16_lanes(tb, at))
            dmin = b.fmul(self.f16_lanes(tb, at + 2 * W), ir.Constant(ir.VectorType(F32, W), [-1.0] * W))
            mv = b.fmul(self.byte_lanes(tb, at + 12 * W + W * s, False), dmin)
            return ws, scv, mv
        run, half = divmod(s, 2)     # Q6_K: sub-blocks of 16, two to a run
        ws = [self._run_vector(tb, run, 4 * half + i) for i in range(4)]
        scv = b.fmul(self.byte_lanes(tb, W * s, True), self.f16_lanes(tb, 16 * W))
        return ws, scv, None


    def stage_block(self, src: ir.Value, dst: ir.Value) -> None:
        W, per = self.W, self.sub
        for s in range(self.n_sub):
            ws, scv, mv = self.sub_weights(src, s)
            for i, w in enumerate(ws):
                self.kb.vstore(w, dst, 4 * W * (per // 4 * s + i))
            self.store_f32(scv, dst, 256 * W + 4 * W * s)
            if mv is not None:
                self.store_f32(mv, dst, 256 * W + 4 * W * (self.n_sub + s))


def emit_repacked(kb: KernelBuilder, sig: KernelSig, int_kernel: type, amx_faster: bool = False) -> None:
    """Per ``tokens_per_call`` token rows: quantize them; per tile of this
    thread's share and K chunk, every token P at a time (the rest in blocks
    of the powers of two below P), prefetching the weight stream ahead;
    then, for ``qmatmul_add`` (``passes/fuse_residual``), each tile's rows
    plus the residual's (or a bias's: the same W values for every row)
    while they are in L1. ``int_kernel``: the weight type's decode kernel
    class, whose unpacking and scales the tiles share."""
    residual = bias = None
    if sig.op == "qmatmul_add":
        residual = kb.in_f32(2)
        bias = len(sig.in_types[2].shape) == 1 and len(sig.in_types[0].shape) > 1
    bsig, base, width = _base_sig(sig)
    kern = int_kernel(kb, bsig, quant_type(base))
    if sig.attr.get("act") == "q8k":
        g = RepackedKQ(kb, bsig, kern, base, width)
    else:
        g = RepackedQ8(kb, bsig, kern, base, width)
    if "norm_eps" in sig.attr:
        _fuse_norm(kb, g, sig)
    kern = g.kern
    b, W = kb.b, g.W
    one = len(sig.in_types[0].shape) < 2
    ts = tokens_per_call(sig)
    P = 1 if one else g.P
    kc = g.nb if one else g.kc            # a decode row: one chain, one pass over the tile
    lo, hi = kb.thread_share(kern.n // W)
    m = kb.rows_of(kern.xt.shape)

    with g.quantized_rows(m, ts) as (t0, n):
        def tiles(chunk) -> None:
            """The K chunks (the first starts its accumulators from zero), every token against each."""
            with kb.loop(lo, hi, name="rtile") as tile:
                r0 = b.mul(tile, i64(W))
                g.k_chunks(r0, kc, chunk)
                if residual is not None:
                    with kb.loop(0, n, name="rres") as s:
                        at = b.add(b.mul(b.add(t0, s), i64(kern.n_out)), r0)
                        o = kb.gep(kern.out, at)
                        kb.vstore(b.fadd(kb.vload(o, 0, W), kb.vload(kb.gep(residual, r0 if bias else at), 0, W)),
                                  o, 0)

        def vnni(r0: ir.Value, c0: int | ir.Value, nblk: int | ir.Value) -> None:
            g.every_token(r0, c0, nblk, n, t0, P)

        if one or not amx_usable(kb, W, sig, amx_faster):
            tiles(vnni)
        else:   # several rows: AMX tiles from MIN_TOKENS on, the rest on the VNNI code (the same bits)
            fill_panels(g, n, g.panel)
            tiles(amx_chunk(g, g.stage, n, t0, g.panel, g.sums,
                            lambda r0, c0, nblk, s0, staged: g.every_token(r0, c0, nblk, n, t0, P, s0)))
    if not one and amx_usable(kb, W, sig, amx_faster):
        amx.tile_release(kb)   # at the end: LLVM configures the tiles once, on entry


def is_repacked(t: TensorType) -> bool:
    return bool(t.repack)
