"""QSF's block quant layouts: 64 values per block, a block never crosses a
row (row length a multiple of 64). Little-endian; f16 is IEEE half.

    layout        bytes  block                               value j (j = 0..63)
    QSF_Q8        66     [d f16][64 x int8 q]                q_j * d
    QSF_Q4        36     [d f16][z f16][32 bytes]            (q_j - z) * d
    QSF_Q2        20     [d f16][m f16][16 bytes]            q_j * d + m
    QSF_Q2S       18     [d f16][16 bytes]                   (q_j - 1.5) * d
    QSF_TERNARY   18     [d f16][sign u64][zero u64]         0 | -d | +d

* Q4: byte i holds q_i in its low nibble and q_{i+32} in its high nibble;
  z is a real-valued zero point in quant units.
* Q2, Q2S: bits 2k..2k+1 of byte i hold q_{i+16k} (k = 0..3), so the
  values 16k..16k+15 are one 16-byte load, a shift and a mask.
* TERNARY: bit j of ``zero`` set -> value j is 0; else bit j of ``sign``
  set -> -d, clear -> +d.

Dequantizers compute in float32 in exactly this order, ``d``, ``z``, ``m``
first widened from f16: ``float(q) * d``, ``(float(q) - z) * d``,
``float(q) * d + m`` (a multiply then an add, no fused multiply-add),
``(float(q) - 1.5) * d``, a select of ``d``, ``-d``, ``0``. The fused
kernels (``compiler/codegen/matmul/decode_qsf.py``) do the same operations, so
decoded weights agree bit for bit.

Each layout also has a quantizer (``quantize_blocks``, ``quantize``) that
searches its block parameters against the squared error as stored, i.e.
with f16-rounded scales; see the methods for how. They take finite values
within the float16 range (|x| <= 65504) and raise ValueError otherwise.

Block sizes and field offsets are the types' rows in ``ir.quant.table``.
``int_blocks`` gives the integer path's view (``ir.int_dot``): each 64-value
block as two 32-value blocks sharing d and the offset m:

    layout        q_w                      d_w    m_w
    QSF_Q8        int8 q                   d      (none)
    QSF_Q4        nibble q, 0..15          d      -z * d
    QSF_Q2        crumb q, 0..3            d      m
    QSF_Q2S       crumb q, 0..3            d      -1.5 * d
    QSF_TERNARY   t in {-1, 0, +1}         d      (none)

Every m_w is exact in float32: d, z and m are float16, and a product of two
float16 values (11-bit significands) fits float32's 24 bits (Q2S: 1.5 has
two). So d_w q_w + m_w equals the layout's float dequantization up to that
one float32 rounding of (q - z) * d, (q - 1.5) * d, which the integer
path's float64 does not make: the values are the same reals.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import BlockLayout, BlockQuantizer

#: values per activation block of the integer path (``ir.int_dot``)
_QA = 32
#: least-squares refinements of (d, z | m) after the candidate search (Q4, Q2):
#: re-fit, re-pick the quants, keep the better. Each gains less (squared
#: error of Q4 on Gaussian blocks: -1.6%, -0.7%, -0.3%, -0.3%, then ~0.1%)
LS_ITERATIONS = 4


# --- reading blocks ------------------------------------------------------------------------------
def _f16_at(blocks: np.ndarray, off: int) -> np.ndarray:
    """The f16 at byte ``off`` of every block, as float32 [nblocks, 1]."""
    return np.ascontiguousarray(blocks[:, off:off + 2]).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """32 bytes -> the 64 4-bit quants (low nibbles first): uint8 [nblocks, 64]."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> the 64 2-bit quants (value i + 16k is bits 2k..2k+1 of byte i)."""
    return np.concatenate([(qs >> np.uint8(2 * k)) & np.uint8(3) for k in range(4)], axis=1)


def _bits64(blocks: np.ndarray, off: int) -> np.ndarray:
    """Bit j of the little-endian u64 at ``off``, for j = 0..63: bool [nblocks, 64]."""
    bits = np.unpackbits(np.ascontiguousarray(blocks[:, off:off + 8]), axis=1, bitorder="little")
    return bits.astype(bool)


# --- writing blocks ------------------------------------------------------------------------------
def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """float16 values [n] or [n, 1] -> their bytes, uint8 [n, 2]."""
    return np.ascontiguousarray(np.asarray(v, "<f2").reshape(-1)).view(np.uint8).reshape(-1, 2)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    q = q.astype(np.uint8)
    return q[:, :32] | (q[:, 32:] << np.uint8(4))


def _pack_crumbs(q: np.ndarray) -> np.ndarray:
    q = q.astype(np.uint8)
    out = np.zeros((q.shape[0], 16), np.uint8)
    for k in range(4):
        out |= q[:, 16 * k:16 * (k + 1)] << np.uint8(2 * k)
    return out


def _pack_bits64(bits: np.ndarray) -> np.ndarray:
    """bool [n, 64] -> the little-endian u64 with bit j = bits[:, j]: uint8 [n, 8]."""
    return np.packbits(bits.astype(np.uint8), axis=1, bitorder="little")


def _to_f16(x: np.ndarray) -> np.ndarray:
    """Round to the nearest float16 (inf where it overflows), back as float32."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def _checked_blocks(name: str, values: np.ndarray, block: int) -> np.ndarray:
    """float32 [nblocks, 64] of finite values within the float16 range. (With
    |x| <= 65504 every search below has finite candidates, so no block can
    silently come out as zeros because its scales overflowed.)"""
    x = np.asarray(values, np.float32)
    if x.ndim != 2 or x.shape[1] != block:
        raise ValueError(f"{name}: quantize_blocks takes float32 [nblocks, {block}], got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name}: cannot quantize non-finite values (inf or nan)")
    amax = float(np.abs(x).max(initial=0))
    if not np.isfinite(_to_f16(amax)):
        raise ValueError(f"{name}: values too large: max |x| = {amax:g} is beyond the float16 range")
    return x


def _sse(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Squared error per block (inf where a is not finite)."""
    with np.errstate(over="ignore", invalid="ignore"):
        d = a - b
        e = np.einsum("...j,...j->...", d, d).astype(np.float64)
    return np.where(np.isfinite(e), e, np.inf)


def _keep_better(new: tuple, old: tuple) -> tuple:
    """Per block, the new parameters (..., err) where their error is lower, else the old."""
    better = new[-1] < old[-1]
    return tuple(np.where(better[..., None] if a.ndim > better.ndim else better, a, b)
                 for a, b in zip(new, old))


def _rint_clip(t: np.ndarray, hi: int) -> np.ndarray:
    """Nearest level in [0, hi] (0 where t is not finite, e.g. a zero scale)."""
    t = np.where(np.isfinite(t), t, 0.0)
    return np.clip(np.rint(t), 0, hi)


# --- layouts ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QSFLayout(BlockQuantizer, BlockLayout):
    """A QSF block type: ``dequant_blocks`` (the reference for the kernels)
    and ``quantize_blocks`` (float32 [nblocks, 64] -> uint8 [nblocks, block_bytes])."""

    #: blocks quantized per numpy call: bounds the memory of the candidate searches
    chunk = 2048

    def quantize_blocks(self, values: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def int_quants(self, blk: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(integer quants [nblocks, 64], offset m float32 [nblocks, 1] or None)."""
        raise NotImplementedError

    def int_blocks(self, raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """A [n, k] weight's stored bytes as 32-value integer blocks: (d
        float32 [n, k/32], q int8 [n, k/32, 32], m float32 [n, k/32] or
        None), value = d * q (+ m); each 64-value block's d and m twice."""
        blk = np.asarray(raw, np.uint8).reshape(-1, self.block_bytes)
        d = _f16_at(blk, self.at("d"))                                 # [blocks, 1]
        q, m = self.int_quants(blk)
        nb = k // _QA

        def per_block(v: np.ndarray) -> np.ndarray:
            return np.repeat(v[:, 0], self.block // _QA).astype(np.float32).reshape(n, nb)

        return (per_block(d), q.astype(np.int8).reshape(n, nb, _QA),
                None if m is None else per_block(m))


@dataclass(frozen=True)
class Q8Layout(QSFLayout):
    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        q = np.ascontiguousarray(blocks[:, self.at("qs"):self.at("qs") + self.block]).view(np.int8)
        return q.astype(np.float32) * _f16_at(blocks, self.at("d"))

    def int_quants(self, blk):
        return np.ascontiguousarray(blk[:, self.at("qs"):self.at("qs") + self.block]).view(np.int8), None

    def quantize_blocks(self, values: np.ndarray) -> np.ndarray:
        """Absmax: d = f16(max|x| / 127), q = round(x / d). Quants are picked
        with the stored (rounded) d, so they are the nearest levels."""
        x = _checked_blocks(self.name, values, self.block)
        d = _to_f16(np.abs(x).max(axis=1, keepdims=True) / np.float32(127))
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.clip(np.rint(np.where(d > 0, x / d, 0)), -127, 127).astype(np.int8)
        return np.concatenate([_f16_bytes(d), q.view(np.uint8)], axis=1)


@dataclass(frozen=True)
class _AffineLayout(QSFLayout):
    """Q4 and Q2: ``nmax + 1`` evenly spaced levels with a free offset.

    Parameters are searched as real (d, m) with value ~ q * d + m and stored
    rounded to f16 (``_store``); every error is measured on the stored,
    rounded parameters and their quants, as the dequantizer will see them.
    """

    nmax: int = 15
    #: candidate steps d = range / (nmax + s): s > 0 clips the block's
    #: extremes, which pays for few levels (2-bit) on bell-shaped data
    grid: tuple[float, float] = (-1.0, 2.0)

    # per-type parts: stored params from real (d, m); quants; values
    def _store(self, d: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def _pick(self, x: np.ndarray, d: np.ndarray, p: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _values(self, q: np.ndarray, d: np.ndarray, p: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _pack(self, d: np.ndarray, p: np.ndarray, q: np.ndarray) -> np.ndarray:
        return np.concatenate([_f16_bytes(d), _f16_bytes(p), self._packq(q)], axis=1)

    def _packq(self, q: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _try(self, x: np.ndarray, d: np.ndarray, m: np.ndarray):
        """Store (d, m), pick the quants, and measure: (d16, p16, q, sse)."""
        with np.errstate(all="ignore"):
            d16, p16 = self._store(d, m)
            q = self._pick(x, d16, p16)
            err = _sse(self._values(q, d16, p16), x)
        bad = ~(np.isfinite(d16) & np.isfinite(p16))[..., 0]
        return d16, p16, q, np.where(bad, np.inf, err)

    def _least_squares(self, x: np.ndarray, q: np.ndarray, d: np.ndarray, m: np.ndarray):
        """The (d, m) minimising sum (q*d + m - x)^2 for fixed quants; where
        all quants are equal only m is fitted. (The sums of 64 terms are
        float32: the quant sums are exact integers there.)"""
        qf = q.astype(np.float32)
        n = x.shape[-1]

        def total(a: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
            s = a.sum(-1) if b is None else np.einsum("...j,...j->...", a, b)
            return s[..., None].astype(np.float64)

        sq, sx, sqq, sqx = total(qf), total(x), total(qf, qf), total(qf, x)
        det = n * sqq - sq * sq
        ok = det > 0
        with np.errstate(all="ignore"):
            d_ls = np.where(ok, (n * sqx - sq * sx) / np.where(ok, det, 1), d)
            m_ls = np.where(ok, (sqq * sx - sq * sqx) / np.where(ok, det, 1), (sx - sq * d) / n)
        return d_ls, m_ls

    def quantize_blocks(self, values: np.ndarray) -> np.ndarray:
        """Search like llama.cpp's ``make_qkx2_quants``, written for f16 params:

        1. candidates: the plain min/max grid, the same grid stretched to
           include 0 (keeps z = -m/d small for one-signed blocks), a grid of
           narrower/wider steps centred on the block, and a constant block;
        2. each candidate's quants get a least-squares fit of (d, m), stored
           and re-picked; the best per block is kept;
        3. ``LS_ITERATIONS`` more rounds of fit / store / re-pick on the best,
           keeping a round only where it lowers the error.
        """
        x = _checked_blocks(self.name, values, self.block)
        n = x.shape[0]
        mn, mx = x.min(1, keepdims=True).astype(np.float64), x.max(1, keepdims=True).astype(np.float64)
        mn0, mx0 = np.minimum(mn, 0), np.maximum(mx, 0)
        mean = x.mean(1, keepdims=True, dtype=np.float64)
        mid, rng = (mn + mx) / 2, mx - mn
        steps = np.arange(self.grid[0], self.grid[1] + 1e-9, 0.25)
        cand_d = [rng / self.nmax, (mx0 - mn0) / self.nmax, *(rng / (self.nmax + s) for s in steps if s)]
        cand_m = [mn, mn0, *(mid - rng / (self.nmax + s) * self.nmax / 2 for s in steps if s)]
        cd = np.stack(cand_d + [self._const_d(mean)])       # [ncand, n, 1]
        cm = np.stack(cand_m + [mean])
        xs = np.broadcast_to(x, (len(cd),) + x.shape)
        # 1.-2. every candidate as is and after one least-squares round
        cur = self._try(xs, cd, cm)
        cur = _keep_better(self._try(xs, *self._least_squares(xs, cur[2], cd, cm)), cur)
        at = (np.argmin(cur[-1], axis=0), np.arange(n))
        cur = tuple(a[at] for a in cur)
        # 3. refine the winner
        for _ in range(LS_ITERATIONS):
            d16, p16, q, _err = cur
            cur = _keep_better(self._try(x, *self._least_squares(x, q, *self._real(d16, p16))), cur)
        return self._pack(*cur[:3])

    def _const_d(self, mean: np.ndarray) -> np.ndarray:
        """d of the constant-block candidate (value = mean for all quants)."""
        return np.zeros_like(mean)

    def _real(self, d16: np.ndarray, p16: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stored params -> real (d, m)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Q4Layout(_AffineLayout):
    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        q = _nibbles(blocks[:, self.at("qs"):self.at("qs") + self.block // 2]).astype(np.float32)
        return (q - _f16_at(blocks, self.at("z"))) * _f16_at(blocks, self.at("d"))

    def int_quants(self, blk):
        return (_nibbles(blk[:, self.at("qs"):self.at("qs") + self.block // 2]),
                -(_f16_at(blk, self.at("z")) * _f16_at(blk, self.at("d"))))

    def _store(self, d, m):
        d16 = _to_f16(d)
        with np.errstate(all="ignore"):
            z16 = _to_f16(np.where(d16 != 0, -m / d16, 0.0))
        return d16, z16

    def _real(self, d16, z16):
        return d16.astype(np.float64), -(z16.astype(np.float64) * d16)

    def _pick(self, x, d16, z16):
        with np.errstate(all="ignore"):
            return _rint_clip(x / d16 + z16, 15).astype(np.uint8)

    def _values(self, q, d16, z16):
        return (q.astype(np.float32) - z16) * d16

    def _const_d(self, mean):
        # (0 - (-1)) * d = d: z = -m/d = -1 with m = d = mean
        return mean

    def _packq(self, q):
        return _pack_nibbles(q)


@dataclass(frozen=True)
class Q2Layout(_AffineLayout):
    nmax: int = 3
    grid: tuple[float, float] = (-1.0, 3.0)

    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        q = _crumbs(blocks[:, self.at("qs"):self.at("qs") + self.block // 4]).astype(np.float32)
        return q * _f16_at(blocks, self.at("d")) + _f16_at(blocks, self.at("m"))

    def int_quants(self, blk):
        return _crumbs(blk[:, self.at("qs"):self.at("qs") + self.block // 4]), _f16_at(blk, self.at("m"))

    def _store(self, d, m):
        return _to_f16(d), _to_f16(m)

    def _real(self, d16, m16):
        return d16.astype(np.float64), m16.astype(np.float64)

    def _pick(self, x, d16, m16):
        with np.errstate(all="ignore"):
            return _rint_clip((x - m16) / d16, 3).astype(np.uint8)

    def _values(self, q, d16, m16):
        return q.astype(np.float32) * d16 + m16

    def _packq(self, q):
        return _pack_crumbs(q)


#: Q2S's candidate scales, as multiples of max|x| / 1.5 (the scale that puts
#: the outer levels on the extremes). Below 1 the outliers are clipped, which
#: pays on bell-shaped data (about 0.6 is best for Gaussian blocks); 3 puts
#: the inner levels on +-max|x| (exact for constant blocks).
Q2S_SCALES = (*np.round(np.arange(0.30, 1.0001, 0.05), 2), 3.0)


@dataclass(frozen=True)
class Q2SLayout(QSFLayout):
    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        q = _crumbs(blocks[:, self.at("qs"):self.at("qs") + self.block // 4]).astype(np.float32)
        return (q - np.float32(1.5)) * _f16_at(blocks, self.at("d"))

    def int_quants(self, blk):
        return (_crumbs(blk[:, self.at("qs"):self.at("qs") + self.block // 4]),
                -(np.float32(1.5) * _f16_at(blk, self.at("d"))))

    @staticmethod
    def _try(x: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Store d, pick the quants, and measure: (d16, q, sse)."""
        with np.errstate(all="ignore"):
            d16 = _to_f16(d)
            q = _rint_clip(x / d16 + np.float32(1.5), 3).astype(np.uint8)
            err = _sse((q.astype(np.float32) - np.float32(1.5)) * d16, x)
        return d16, q, np.where(np.isfinite(d16[..., 0]), err, np.inf)

    def quantize_blocks(self, values: np.ndarray) -> np.ndarray:
        """Grid search over ``Q2S_SCALES`` x max|x|/1.5 (vectorised: all
        candidates at once), then two least-squares refits of d on the
        winner's quants, kept where they lower the error."""
        x = _checked_blocks(self.name, values, self.block)
        n = x.shape[0]
        base = np.abs(x).max(1, keepdims=True).astype(np.float64) / 1.5
        cand = np.stack([base * f for f in Q2S_SCALES])
        d16, q, err = self._try(np.broadcast_to(x, (len(cand),) + x.shape), cand)
        at = (np.argmin(err, axis=0), np.arange(n))
        cur = d16[at], q[at], err[at]
        for _ in range(2):
            c = cur[1].astype(np.float64) - 1.5
            d_ls = (c * x).sum(1, keepdims=True) / (c * c).sum(1, keepdims=True)  # sum c^2 >= 16
            cur = _keep_better(self._try(x, d_ls), cur)
        return np.concatenate([_f16_bytes(cur[0]), _pack_crumbs(cur[1])], axis=1)


@dataclass(frozen=True)
class TernaryLayout(QSFLayout):
    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        d = _f16_at(blocks, self.at("d"))
        signed = np.where(_bits64(blocks, self.at("sign")), -d, d)
        return np.where(_bits64(blocks, self.at("zero")), np.float32(0), signed).astype(np.float32)

    def int_quants(self, blk):   # zero wins over sign
        t = np.where(_bits64(blk, self.at("sign")), np.int8(-1), np.int8(1))
        return np.where(_bits64(blk, self.at("zero")), np.int8(0), t), None

    def quantize_blocks(self, values: np.ndarray) -> np.ndarray:
        """Every threshold at once: with |x| sorted descending, keeping the
        k largest costs sum(x^2) - 2 d S_k + k d^2 (S_k their sum, d = f16 of
        S_k / k, the least-squares d rounded). The best k of 0..64 per block."""
        x = _checked_blocks(self.name, values, self.block)
        a = np.abs(x).astype(np.float64)
        order = np.argsort(-a, axis=1, kind="stable")
        s1 = np.cumsum(np.take_along_axis(a, order, axis=1), axis=1)      # S_k, k = 1..64
        total = (a * a).sum(1, keepdims=True)
        k = np.arange(1, self.block + 1, dtype=np.float64)
        d = _to_f16(s1 / k).astype(np.float64)
        with np.errstate(invalid="ignore"):
            err = total - 2 * d * s1 + k * d * d
        err = np.where(np.isfinite(err), err, np.inf)
        err = np.concatenate([total, err], axis=1)                          # k = 0: all zero
        kbest = np.argmin(err, axis=1)
        dbest = np.where(kbest > 0, d[np.arange(len(x)), np.maximum(kbest - 1, 0)], 0.0)
        rank = np.argsort(order, axis=1)
        nonzero = rank < kbest[:, None]
        sign = nonzero & (x < 0)
        return np.concatenate([_f16_bytes(dbest), _pack_bits64(sign), _pack_bits64(~nonzero)], axis=1)
