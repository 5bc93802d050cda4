"""Repacked weights: a quantized matrix regrouped W rows at a time for the
integer GEMM (W = 16: one AVX-512 register of int32 lanes; 8 on hosts whose
VNNI is 256 bits wide).

Why: ``vpdpbusd`` multiplies 4 weight bytes by 4 activation bytes per int32
lane. With W output rows in the lanes, each lane holding 4 consecutive
values of its row, one instruction does 4W products and the sums stay in
lanes: no horizontal sums, and a broadcast activation serves every row. A
file's row-major blocks have to be transposed into that order first; the
GEMM of prompt chunks (``matmul/gemm``) does it per call, which a
decode step of one token cannot afford (2-3x the time of the row-major
decode kernel). So the runtime does it once, at load, into this layout, and
then decode, prompt chunks, batches of decode rows and speculative checks
all run the same kernel (``matmul/repacked``): every row of every step is
computed with one arithmetic, whatever else shares the call.

A repacked tensor is ``rows / W`` tiles, each the tile's blocks in order;
a tile block is the W rows' block j (32 values; 256 for the K-quants),
quants first. "A vector" is 4W bytes, byte 4r + c holding value 4i + c of
row r for the vector's i (the GEMM's VNNI order):

    Q8_0  8 vectors of q + 128 (unsigned), d[W] f16                       34W bytes
    Q4_0  4 vectors of nibble pairs, d[W]                                 18W
    Q4_1  as Q4_0, then m[W] f16                                          20W
    Q5_0  as Q4_0, 8 masks of 4W bits (bit 4r + c: the fifth bit of
          vector i's value), d[W]                                         22W
    Q5_1  as Q5_0, then m[W]                                              24W

Nibble pair vector v: the low nibble is value 4v + c, the high nibble value
16 + 4v + c, which is the file's quant byte 4v + c of the row unchanged.
The quants keep the file's unsigned form (Q4_0 q + 8, Q5_0 q + 16; Q8_0 is
made unsigned here), which the kernel's bias correction expects.

K-quants (per super-block of 256 values; runs of 32 values, run 2g and
2g + 1 sharing nibble pair vectors; Q2_K and Q3_K keep the file's layout):

    Q4_K  32 vectors (g, i): low nibble run 2g, high run 2g + 1, value
          32 run + 4i + c (the file's quant byte 32g + 4i + c);
          d[W] f16, dmin[W] f16, sc[8][W] u8, m[8][W] u8                 148W
    Q5_K  Q4_K's 32 nibble vectors (its file's quant byte 32g + 4i + c
          at 48 instead of 16), then 64 masks (run r, vector i) of 4W bits:
          bit 4r' + c = the fifth bit of row r''s value 32r + 4i + c (bit r
          of its qh byte 4i + c); d, dmin, sc[8][W], m[8][W] as Q4_K's     180W
    Q6_K  per group g: 8 nibble pair vectors of the low 4 bits of u =
          q + 32, as Q4_K's, then 4 vectors k of 2-bit high parts, bits
          2t, 2t + 1 of a byte for vector 4k + t of the group (0..7 run
          2g, 8..15 run 2g + 1); then sc[16][W] i8, d[W] f16             210W
          (the groups one after the other: one sequential stream)

Scales and minimums are stored unpacked, one byte per row and sub-block,
so the kernel reads W of them with one load.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..dims import Dim
from .base import Layout
from .kquants import scale_min_k4
from .table import QuantType, quant_type, repackable

#: base layouts that have a repacked form (their rows' ``tile_bytes``), and the tile widths
REPACKABLE = repackable()
WIDTHS = (8, 16)


def repacked_name(base: str, width: int) -> str:
    """``Q5_0`` at width 16 -> ``Q5_0x16``."""
    return f"{base}x{width}"


def split_repacked(name: str | None) -> tuple[str, int] | None:
    """``Q5_0x16`` -> (``Q5_0``, 16); None for any other name."""
    if not name or "x" not in name:
        return None
    base, _, w = name.rpartition("x")
    if base in REPACKABLE and w.isdigit() and int(w) in WIDTHS:
        return base, int(w)
    return None


def base_layout(name: str | None) -> str | None:
    """The file layout behind a layout name (itself when not repacked)."""
    s = split_repacked(name)
    return s[0] if s else name


def can_repack(base: str | None, rows: int, cols: int, width: int) -> bool:
    """Whether a [rows, cols] weight of layout ``base`` has a repacked form at ``width``."""
    return (base in REPACKABLE and width in WIDTHS and rows > 0 and rows % width == 0
            and cols > 0 and cols % quant_type(base).block == 0)


@dataclass(frozen=True)
class RepackedLayout(Layout):
    """A ``base`` layout's blocks, ``width`` rows at a time (module docstring)."""

    base: str = "Q8_0"
    width: int = 16

    @property
    def qt(self) -> QuantType:
        return quant_type(self.base)

    @property
    def block(self) -> int:
        return self.qt.block

    @property
    def tile_block_bytes(self) -> int:
        """Bytes of one block of a W-row tile."""
        return self.qt.tile_bytes * self.width

    def nbytes(self, shape: tuple[Dim, ...]) -> int:
        rows, cols = int(shape[0]), int(shape[-1])
        if len(shape) != 2 or not can_repack(self.base, rows, cols, self.width):
            raise ValueError(f"{self.name}: a [{rows}, {cols}] weight has no {self.width}-row repacked form")
        return rows // self.width * (cols // self.block) * self.tile_block_bytes

    def repack(self, raw: np.ndarray, rows: int, cols: int, out: np.ndarray | None = None) -> np.ndarray:
        """The base layout's bytes of a [rows, cols] weight -> this layout's
        (into ``out`` when given: uint8 of ``nbytes``). Rows [a, b) of whole
        tiles repack on their own into bytes [a / W, b / W) x the tile's
        bytes: callers may split a large weight between threads."""
        nb, W = cols // self.block, self.width
        bb = self.qt.block_bytes
        src = np.asarray(raw, np.uint8)[: rows * nb * bb]
        dst = np.empty(self.nbytes((rows, cols)), np.uint8) if out is None else out
        blocks = src.reshape(rows // W, W, nb, bb)                  # tile, r, j, byte
        tiles = dst.reshape(rows // W, nb, self.tile_block_bytes)   # tile, j, byte
        step = max(1, _CHUNK_BYTES // (W * nb * bb))
        pack = _PACK[self.base]
        for lo in range(0, rows // W, step):     # a few MB at a time: temporaries stay small
            pack(self.qt, blocks[lo:lo + step], tiles[lo:lo + step], W)
        return dst

    def unrepack(self, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
        """This layout's bytes -> the base layout's (the inverse of ``repack``)."""
        nb, W = cols // self.block, self.width
        tiles = np.asarray(raw, np.uint8)[: self.nbytes((rows, cols))].reshape(rows // W, nb, self.tile_block_bytes)
        blocks = _UNPACK[self.base](self.qt, tiles, W)              # tile, j, r, byte
        return np.ascontiguousarray(blocks.transpose(0, 2, 1, 3)).reshape(-1)

    def dequantize(self, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        rows, cols = int(shape[0]), int(shape[1])
        return self.qt.layout.dequantize(self.unrepack(raw, rows, cols), shape)

    def dequantize_rows(self, raw: np.ndarray, shape: tuple[int, ...], rows: np.ndarray) -> np.ndarray:
        n, cols = int(shape[0]), int(shape[1])
        return self.qt.layout.dequantize_rows(self.unrepack(raw, n, cols), shape, rows)


#: source bytes repacked per numpy pass
_CHUNK_BYTES = 256 << 10


# --- the 32-value layouts -----------------------------------------------------------------------
def _vectors(q: np.ndarray, nvec: int) -> np.ndarray:
    """[..., W, 4 nvec] bytes per row -> [..., nvec * 4W]: vector i holds bytes 4i..4i+3 of every row."""
    *lead, W, n = q.shape
    return q.reshape(*lead, W, nvec, 4).swapaxes(-3, -2).reshape(*lead, nvec * 4 * W)


def _unvectors(v: np.ndarray, W: int, nvec: int) -> np.ndarray:
    """The inverse of ``_vectors``: [..., nvec * 4W] -> [..., W, 4 nvec]."""
    *lead, _ = v.shape
    return v.reshape(*lead, nvec, W, 4).swapaxes(-3, -2).reshape(*lead, W, 4 * nvec)


def _masks(qh: np.ndarray) -> np.ndarray:
    """[..., W, 4] bytes of each row's 32 fifth bits -> [..., 8 * W / 2]: mask i
    has bit 4r + c = bit 4i + c of row r (the nibble i of its qh)."""
    *lead, W, _ = qh.shape
    h = qh.view("<u4")[..., 0]                                         # [..., W]
    nib = (h[..., None, :] >> (4 * np.arange(8, dtype=np.uint32))[:, None]) & 15   # [..., 8, W]
    nib = nib.astype(np.uint8).reshape(*lead, 8, W // 2, 2)
    return (nib[..., 0] | (nib[..., 1] << 4)).reshape(*lead, 4 * W)


def _unmasks(m: np.ndarray, W: int) -> np.ndarray:
    *lead, _ = m.shape
    b = m.reshape(*lead, 8, W // 2)
    nib = np.stack([b & 15, b >> 4], axis=-1).reshape(*lead, 8, W).astype(np.uint32)   # [..., 8, W]
    h = (nib << (4 * np.arange(8, dtype=np.uint32))[:, None]).sum(axis=-2, dtype=np.uint32)
    return np.ascontiguousarray(h).view(np.uint8).reshape(*lead, W, 4)


def _f16s(blk: np.ndarray, at: int) -> np.ndarray:
    """[..., W, bytes] -> [..., 2W]: the float16 at byte ``at`` of every row, in row order."""
    *lead, W, _ = blk.shape
    return np.ascontiguousarray(blk[..., at:at + 2]).reshape(*lead, 2 * W)


def _unf16s(v: np.ndarray, W: int) -> np.ndarray:
    *lead, _ = v.shape
    return v.reshape(*lead, W, 2)


def _unpack32(qt: QuantType, t: np.ndarray, W: int) -> np.ndarray:
    """Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 tile blocks back to the file's blocks (``_pack32``'s inverse)."""
    out = np.empty(t.shape[:-1] + (W, qt.block_bytes), np.uint8)
    qs, d = qt.at("qs"), qt.at("d")
    if qt.name == "Q8_0":
        out[..., qs:qs + 32] = _unvectors(t[..., :32 * W], W, 8) ^ np.uint8(0x80)
        out[..., d:d + 2] = _unf16s(t[..., 32 * W:34 * W], W)
        return out
    out[..., qs:qs + 16] = _unvectors(t[..., :16 * W], W, 4)
    at = 16 * W
    if qt.has("qh"):
        out[..., qt.at("qh"):qt.at("qh") + 4] = _unmasks(t[..., at:at + 4 * W], W)
        at += 4 * W
    out[..., d:d + 2] = _unf16s(t[..., at:at + 2 * W], W)
    if qt.offset:
        out[..., qt.at("m"):qt.at("m") + 2] = _unf16s(t[..., at + 2 * W:at + 4 * W], W)
    return out


# --- K-quants -----------------------------------------------------------------------------------
def _pair_vectors(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Low and high 4-bit parts [..., W, 4 groups, 32] (run 2g, run 2g + 1)
    -> [..., 4 * 8 * 4W]: vector (g, i) lane (r, c) = lo[r, g, 4i + c] | hi[r, g, 4i + c] << 4."""
    *lead, W, G, n = lo.shape
    b = (lo | (hi << 4)).reshape(*lead, W, G, 8, 4)
    return np.moveaxis(b, -4, -2).reshape(*lead, G * 8 * 4 * W)       # g, i, r, c


def _unpair_vectors(v: np.ndarray, W: int) -> tuple[np.ndarray, np.ndarray]:
    *lead, _ = v.shape
    b = np.moveaxis(v.reshape(*lead, 4, 8, W, 4), -2, -4).reshape(*lead, W, 4, 32)
    return b & 15, b >> 4


def _rows_bytes(x: np.ndarray) -> np.ndarray:
    """[..., W, S] one byte per row and sub-block -> [..., S * W], sub-block major."""
    *lead, W, S = x.shape
    return x.swapaxes(-1, -2).reshape(*lead, S * W)


def _unrows_bytes(v: np.ndarray, W: int, S: int) -> np.ndarray:
    *lead, _ = v.shape
    return v.reshape(*lead, S, W).swapaxes(-1, -2)


def _pack_scale_min_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """(scales, mins) uint8 [..., 8] -> the 12 packed bytes (``scale_min_k4``'s inverse)."""
    out = np.empty(sc.shape[:-1] + (12,), np.uint8)
    out[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    return out


def _unpack_kfactors(qt: QuantType, t: np.ndarray, out: np.ndarray, at: int, W: int) -> None:
    """Q4_K/Q5_K: d, dmin and the packed scales and minimums back from the
    repacked factors at byte ``at`` (``_put_kfactors``' inverse)."""
    d, dmin, scales = qt.at("d"), qt.at("dmin"), qt.at("scales")
    out[..., d:d + 2] = _unf16s(t[..., at:at + 2 * W], W)
    out[..., dmin:dmin + 2] = _unf16s(t[..., at + 2 * W:at + 4 * W], W)
    sc = _unrows_bytes(t[..., at + 4 * W:at + 12 * W], W, 8)
    mn = _unrows_bytes(t[..., at + 12 * W:at + 20 * W], W, 8)
    out[..., scales:scales + 12] = _pack_scale_min_k4(sc, mn)


def _unpack_q4k(qt: QuantType, t: np.ndarray, W: int) -> np.ndarray:
    out = np.empty(t.shape[:-1] + (W, qt.block_bytes), np.uint8)
    lo, hi = _unpair_vectors(t[..., :128 * W], W)
    qs = qt.at("qs")
    out[..., qs:qs + 128] = (lo | (hi << 4)).reshape(*out.shape[:-1], 128)
    _unpack_kfactors(qt, t, out, 128 * W, W)
    return out


def _q5k_masks(qh: np.ndarray, W: int) -> np.ndarray:
    """[t, r', j, 32] fifth-bit bytes -> [t, j, 8 runs, 8 vectors, W / 2] mask bytes
    (byte k: the 4 bits of rows 2k, 2k + 1). Four bytes at a time, rows innermost
    (numpy is slow on short inner loops): bit ``run`` of bytes 4i..4i+3, one in each
    byte, gathered into a nibble by one multiply."""
    t, _, nb, _ = qh.shape
    words = np.ascontiguousarray(qh.view("<u4").transpose(0, 2, 3, 1))       # [t, j, i, r']
    out = np.empty((t, nb, 8, 8, W // 2), np.uint8)
    for run in range(8):
        nib = (((words >> np.uint32(run)) & np.uint32(0x01010101)) * np.uint32(0x01020408)) >> np.uint32(24)
        out[:, :, run] = nib[..., 0::2] | (nib[..., 1::2] << np.uint32(4))
    return out


def _q5k_unmasks(m: np.ndarray, W: int) -> np.ndarray:
    """The inverse of ``_q5k_masks``: [..., 8, 8, W / 2] -> [..., W, 32] qh bytes."""
    *lead, _, _, _ = m.shape
    nib = np.stack([m & 15, m >> 4], axis=-1).reshape(*lead, 8, 8, W)                  # [..., run, i, r']
    bits = (nib[..., None] >> np.arange(4, dtype=np.uint8)) & 1                          # [..., run, i, r', c]
    bits = np.moveaxis(bits, -2, -4)                                                     # [..., r', run, i, c]
    bits = bits.reshape(*lead, W, 8, 32)
    return (bits << np.arange(8, dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8)      # [..., r', 32]


def _unpack_q5k(qt: QuantType, t: np.ndarray, W: int) -> np.ndarray:
    out = np.empty(t.shape[:-1] + (W, qt.block_bytes), np.uint8)
    lo, hi = _unpair_vectors(t[..., :128 * W], W)
    qs, qh = qt.at("qs"), qt.at("qh")
    out[..., qs:qs + 128] = (lo | (hi << 4)).reshape(*out.shape[:-1], 128)
    out[..., qh:qh + 32] = _q5k_unmasks(t[..., 128 * W:160 * W].reshape(*t.shape[:-1], 8, 8, W // 2), W)
    _unpack_kfactors(qt, t, out, 160 * W, W)
    return out


def _q6k_bytes(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The unsigned quants u = q + 32 (0..63) [..., 256] in value order -> the file's
    (ql [..., 128], qh [..., 64])."""
    lead = u.shape[:-1]
    v = u.reshape(*lead, 2, 4, 32)
    lo, hi = v & 15, v >> 4
    ql = lo[..., 0:2, :] | (lo[..., 2:4, :] << 4)
    qh = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)
    return ql.reshape(*lead, 128), qh.reshape(*lead, 64)


def _unpack_q6k(qt: QuantType, t: np.ndarray, W: int) -> np.ndarray:
    lead = t.shape[:-1]
    out = np.empty(lead + (W, qt.block_bytes), np.uint8)
    groups = t[..., 20 * W:].reshape(*lead, 4, 48 * W)
    lo, hi = _unpair_vectors(np.ascontiguousarray(groups[..., :32 * W]).reshape(*lead, 128 * W), W)
    hv = np.moveaxis(groups[..., 32 * W:].reshape(*lead, 4, 4, W, 4), -2, -4)   # r, g, k, c
    h = (hv[..., None, :] >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3      # r, g, k, t, c
    h = h.reshape(*lead, W, 4, 2, 32)
    u = np.stack([lo, hi], axis=-2) | (h << 4)                            # r, g, h, value
    ql, qh = _q6k_bytes(u.reshape(*lead, W, 256))
    out[..., qt.at("ql"):qt.at("ql") + 128], out[..., qt.at("qh"):qt.at("qh") + 64] = ql, qh
    out[..., qt.at("scales"):qt.at("scales") + 16] = _unrows_bytes(t[..., :16 * W], W, 16)
    out[..., qt.at("d"):qt.at("d") + 2] = _unf16s(t[..., 16 * W:18 * W], W)
    return out



# --- packing: file blocks [tile, r, j, byte] straight into tile blocks [tile, j, byte] --------------
def _u32s(src: np.ndarray, lo: int, n: int) -> np.ndarray:
    """Bytes [lo, lo + 4n) of every block of [tile, r, j, byte], as uint32 [tile, r, j, n]
    (a view: the block's bytes are contiguous, and the copy cost a third of a repack)."""
    return src[..., lo:lo + 4 * n].view("<u4")


def _put_vectors(dst: np.ndarray, at: int, words: np.ndarray, W: int) -> None:
    """uint32 [tile, r, j, n] (4 bytes of row r each) -> n vectors of 4W bytes at
    byte ``at`` of each tile block: vector i lane r = word i of row r."""
    t, _, nb, n = words.shape
    dst[..., at:at + 4 * W * n].view("<u4").reshape(t, nb, n, W)[...] = words.transpose(0, 2, 3, 1)


def _put_rows(dst: np.ndarray, at: int, vals: np.ndarray, W: int) -> None:
    """[tile, r, j, n] values of any dtype -> n runs of W (one per row) at byte ``at``."""
    t, _, nb, n = vals.shape
    size = vals.dtype.itemsize
    dst[..., at:at + size * W * n].view(vals.dtype).reshape(t, nb, n, W)[...] = vals.transpose(0, 2, 3, 1)


def _put_masks(dst: np.ndarray, at: int, qh: np.ndarray, W: int) -> None:
    """The 4 bytes of fifth bits per row [tile, r, j, 4] -> 8 masks of 4W bits:
    mask i bit 4r + c = bit 4i + c of row r, so byte k of a mask holds
    nibble i of rows 2k (low) and 2k + 1 (high)."""
    t, _, nb, _ = qh.shape
    even, odd = qh[:, 0::2], qh[:, 1::2]                                 # rows 2k, 2k + 1: [t, k, j, b]
    masks = dst[..., at:at + 4 * W].reshape(t, nb, 4, 2, W // 2)         # mask i = 2b + (0, 1), byte k
    masks[:, :, :, 0] = ((even & 15) | (odd << 4)).transpose(0, 2, 3, 1)           # nibble 2b: low halves
    masks[:, :, :, 1] = ((even >> 4) | (odd & 0xF0)).transpose(0, 2, 3, 1)         # nibble 2b + 1: high


def _f16_pair(src: np.ndarray, a: int, b: int) -> np.ndarray:
    """The float16s at bytes a and b of every block, as uint16 [..., 2]."""
    if b == a + 2:   # side by side (Q4_1's d and m, the K-quants' d and dmin): a view
        return src[..., a:a + 4].view("<u2")
    return np.stack([np.ascontiguousarray(src[..., a:a + 2]).view("<u2")[..., 0],
                     np.ascontiguousarray(src[..., b:b + 2]).view("<u2")[..., 0]], axis=-1)


def _pack32(qt: QuantType, src: np.ndarray, dst: np.ndarray, W: int) -> None:
    """Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 file blocks into tile blocks (module docstring)."""
    qs, d = qt.at("qs"), qt.at("d")
    if qt.name == "Q8_0":
        _put_vectors(dst, 0, _u32s(src, qs, 8), W)
        dst[..., :32 * W].view("<u4")[...] ^= np.uint32(0x80808080)   # in place: no temporary
        _put_rows(dst, 32 * W, src[..., d:d + 2].view("<u2"), W)
        return
    _put_vectors(dst, 0, _u32s(src, qs, 4), W)
    at = 16 * W
    if qt.has("qh"):
        _put_masks(dst, at, src[..., qt.at("qh"):qt.at("qh") + 4], W)
        at += 4 * W
    if qt.offset:        # d then m, W of each
        _put_rows(dst, at, _f16_pair(src, d, qt.at("m")), W)
    else:
        _put_rows(dst, at, src[..., d:d + 2].view("<u2"), W)


def _put_kfactors(qt: QuantType, src: np.ndarray, dst: np.ndarray, at: int, W: int) -> None:
    """Q4_K/Q5_K: d, dmin (W float16 each), then the 8 scales and the 8
    minimums unpacked to bytes (8W each), from byte ``at``."""
    t, _, nb, _ = src.shape
    _put_rows(dst, at, _f16_pair(src, qt.at("d"), qt.at("dmin")), W)
    scales = qt.at("scales")
    sc, mn = scale_min_k4(np.ascontiguousarray(src[..., scales:scales + 12]).reshape(-1, 12))
    _put_rows(dst, at + 4 * W, sc.reshape(t, W, nb, 8), W)
    _put_rows(dst, at + 12 * W, mn.reshape(t, W, nb, 8), W)


def _pack_q4k(qt: QuantType, src: np.ndarray, dst: np.ndarray, W: int) -> None:
    _put_vectors(dst, 0, _u32s(src, qt.at("qs"), 32), W)
    _put_kfactors(qt, src, dst, 128 * W, W)


def _pack_q5k(qt: QuantType, src: np.ndarray, dst: np.ndarray, W: int) -> None:
    t, _, nb, _ = src.shape
    qh = qt.at("qh")
    _put_vectors(dst, 0, _u32s(src, qt.at("qs"), 32), W)
    dst[..., 128 * W:160 * W].reshape(t, nb, 8, 8, W // 2)[...] = _q5k_masks(src[..., qh:qh + 32], W)
    _put_kfactors(qt, src, dst, 160 * W, W)


def _pack_q6k(qt: QuantType, src: np.ndarray, dst: np.ndarray, W: int) -> None:
    """Straight from the file's bytes (not through the 256 values), 4 bytes at a
    time and rows innermost, the tile's order (numpy is slow on short inner
    loops): value h * 128 + i * 32 + l has low bits ql[h, i % 2, l] >> 4 (i // 2)
    and high bits qh[h, l] >> 2 i; group g = 2 h + i // 2 holds runs i = 2 (g % 2)
    and 2 (g % 2) + 1."""
    t, _, nb, _ = src.shape
    sc, d = qt.at("scales"), qt.at("d")
    _put_rows(dst, 0, src[..., sc:sc + 16], W)                          # sc
    _put_rows(dst, 16 * W, src[..., d:d + 2].view("<u2"), W)            # d
    dst[..., 18 * W:20 * W] = 0
    groups = dst[..., 20 * W:].reshape(t, nb, 4, 48 * W)
    # low bits: vector (g, v) lane r = bytes 4v..4v+3 of runs 2 (g % 2) | 2 (g % 2) + 1 << 4
    ql = np.ascontiguousarray(src[..., qt.at("ql"):qt.at("ql") + 128].view("<u4")
                              .reshape(t, W, nb, 2, 2, 8).transpose(3, 4, 0, 2, 5, 1))   # h, i % 2, t, j, v, r
    lo = groups[..., :32 * W].view("<u4").reshape(t, nb, 2, 2, 8, W)                     # t, j, h, g % 2, v, r
    m = np.uint32(0x0F0F0F0F)
    for h in range(2):
        lo[:, :, h, 0] = (ql[h, 0] & m) | ((ql[h, 1] << np.uint32(4)) & ~m)   # runs 0, 1: low nibbles
        lo[:, :, h, 1] = ((ql[h, 0] >> np.uint32(4)) & m) | (ql[h, 1] & ~m)  # runs 2, 3: high nibbles
    # high bits: byte c of vector (g, k) packs the 2-bit fields of values 16 k + 4 tt + c
    # of group g at bits 2 tt; k < 2 in run 2 (g % 2), k >= 2 in the next
    qh = np.ascontiguousarray(src[..., qt.at("qh"):qt.at("qh") + 64].view("<u4")
                              .reshape(t, W, nb, 2, 2, 4).transpose(5, 0, 2, 3, 4, 1))   # tt, t, j, h, k % 2, r
    hi = groups[..., 32 * W:].view("<u4").reshape(t, nb, 2, 2, 2, 2, W)                  # t, j, h, g % 2, k // 2, k % 2, r
    three = np.uint32(0x03030303)
    for i in range(4):
        f = [(qh[tt] >> np.uint32(2 * i)) & three for tt in range(4)]
        hi[:, :, :, i // 2, i % 2] = f[0] | (f[1] << np.uint32(2)) | (f[2] << np.uint32(4)) | (f[3] << np.uint32(6))


#: how each repackable type's blocks go into tiles and back (its row's ``tile_bytes`` is the size)
_PACK = {"Q4_K": _pack_q4k, "Q5_K": _pack_q5k, "Q6_K": _pack_q6k}
_UNPACK = {"Q4_K": _unpack_q4k, "Q5_K": _unpack_q5k, "Q6_K": _unpack_q6k}
for _base in REPACKABLE:
    if quant_type(_base).block == 32:
        _PACK[_base], _UNPACK[_base] = _pack32, _unpack32


@functools.cache
def repacked_layout(base: str, width: int) -> RepackedLayout:
    """The layout of ``base`` weights repacked ``width`` rows at a time."""
    if base not in REPACKABLE or width not in WIDTHS:
        raise KeyError(f"no repacked layout of {base} at width {width}")
    return RepackedLayout(repacked_name(base, width), 1, "u1", base, width)
