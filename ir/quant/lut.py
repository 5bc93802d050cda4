"""GGUF's table types: 4-bit indices into a 16-entry table of int8 values
(IQ4_NL, IQ4_XS, MXFP4), as llama.cpp stores them.

    type     bytes  block                                           value j
    IQ4_NL   18     [d f16][16 x nibble pairs]                      d * K[i_j]
    IQ4_XS   136    [d f16][scales_h u16][scales_l 4 x u8][128 x nibble pairs]
                    8 sub-blocks of 32, each with a 6-bit scale ls   d * (ls - 32) * K[i_j]
    MXFP4    17     [e u8][16 x nibble pairs]                       K[i_j] * 2^(e - 128)

``K`` is the type's table: ``KVALUES_IQ4NL`` (a non-linear 4-bit code, dense
near zero) for both IQ4 types, ``KVALUES_MXFP4`` (the E2M1 values of OCP's
microscaling format, doubled so they are integers) for MXFP4. Nibbles come
as in Q4_0: the low nibbles of 16 bytes are values 0..15 of a 32-value
(sub-)block, the high nibbles values 16..31. IQ4_XS's sub-block s has its
16 bytes at ``qs + 16 s``; its scale's low 4 bits are nibble s % 2 of
``scales_l[s // 2]`` (bits 4s..4s+3 of the little-endian u32), its high 2
bits are bits 2s, 2s+1 of ``scales_h``. MXFP4's scale is E8M0, a bare
exponent byte; ggml reads it halved (``GGML_E8M0_TO_FP32_HALF``: 2^(e-128),
float32 subnormal for e < 2), because the table holds doubled values.

The dequantizers compute in float32 in ggml's order, so they agree with it
bit for bit: ``d * K`` (IQ4_NL); ``dl = d * (ls - 32)``, then ``dl * K``
(IQ4_XS; ``dl`` is exact: an 11-bit significand times a 6-bit integer);
``2^(e-128) * K`` (MXFP4; exact unless it overflows to inf).

The integer path (``ir.int_dot``, ``act="q8"``, ``int_blocks``): the
weight's integer quants are the table values ``K[i]`` themselves (int8) and
its block scale d_w is ``d``, ``d * (ls - 32)`` per 32-value sub-block
(IQ4_XS: each sub-block one integer block), or ``2^(e-128)``; no offset.
The kernels make them unsigned as ``K[i] + zero`` (the type's row) with one
byte lookup of the table plus ``zero``.

``quantize`` (float32 [rows, cols] -> stored bytes): IQ4_NL and IQ4_XS
search the scale that minimises the squared error of the stored block
(llama.cpp's ``quantize_row_iq4_nl`` idea: the largest value placed on
each end of the table with a few stretches, then a least-squares refit;
written here for numpy, errors measured with the rounded, stored scales);
MXFP4 picks ggml's exponent (``floor(log2 max|x|) - 2``, so 12 * 2^(e-128)
covers max|x| to within 25%) and the nearest table value per element,
which is what ``gguf.quants.quantize`` writes, byte for byte.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import BlockLayout, BlockQuantizer
from .gguf import f16_at, nibbles

#: IQ4_NL's and IQ4_XS's table (ggml's ``kvalues_iq4nl``), ascending
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
#: MXFP4's table (ggml's ``kvalues_mxfp4``): E2M1 code c -> twice its value
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

#: values per nibble block (and per IQ4_XS sub-block)
_QB = 32
#: stretches tried when a block's largest value is put on an end of the table
_STRETCH = tuple(range(-7, 8))


# --- helpers ---------------------------------------------------------------------------------------
def e8m0_half(e: np.ndarray) -> np.ndarray:
    """E8M0 exponent bytes -> 2^(e - 128) as float32 (subnormal for e < 2), by its bits."""
    e = np.asarray(e, np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _to_f16(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(v, "<f2").reshape(-1)).view(np.uint8).reshape(-1, 2)


def _pack_nibbles(idx: np.ndarray) -> np.ndarray:
    """uint8 [m, 32] indices -> [m, 16]: value j in the low, j + 16 in the high nibble of byte j."""
    idx = idx.astype(np.uint8)
    return idx[:, :16] | (idx[:, 16:] << np.uint8(4))


def _nearest(v: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest entry of an ascending ``table`` to each v (0 for nan)."""
    mids = (table[1:] + table[:-1]) / 2
    v = np.where(np.isfinite(v), v, 0.0)
    return np.searchsorted(mids, v).astype(np.uint8)


def _sse(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        d = (a - b).astype(np.float64)
        e = np.einsum("...j,...j->...", d, d)
    return np.where(np.isfinite(e), e, np.inf)


def _checked(name: str, values: np.ndarray, block: int, limit: float) -> np.ndarray:
    x = np.asarray(values, np.float32)
    if x.ndim != 2 or x.shape[1] != block:
        raise ValueError(f"{name}: quantize_blocks takes float32 [nblocks, {block}], got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name}: cannot quantize non-finite values (inf or nan)")
    amax = float(np.abs(x).max(initial=0))
    if amax > limit:
        raise ValueError(f"{name}: values too large: max |x| = {amax:g} is beyond {limit:g}")
    return x


def _fit_scales(x: np.ndarray, table: np.ndarray, store) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The best scale of each 32-value row of x [m, 32] for values d * table[i]:
    (stored d [m, 1], indices uint8 [m, 32], squared error [m]). Candidates put
    the row's largest value (signed) on either end of the table, stretched by
    ``_STRETCH`` levels; each is stored (``store``: the rounding of the
    format), its indices picked, and refitted once by least squares; every
    error is measured on the stored scale."""
    m = x.shape[0]
    at = np.abs(x).argmax(axis=1)
    mx = x[np.arange(m), at].astype(np.float64)[:, None]                     # signed, largest |x|
    ends = [table[0] + t for t in _STRETCH] + [table[-1] + t for t in _STRETCH]
    cand = np.stack([mx / e for e in ends])                                  # [C, m, 1]

    def attempt(d):
        with np.errstate(all="ignore"):
            ds = store(d)
            idx = _nearest(x / ds, table)
            err = _sse(ds * table[idx], x)
        return ds, idx, np.where(np.isfinite(ds[..., 0]), err, np.inf)

    best = attempt(cand)
    kv = table[best[1]].astype(np.float64)
    with np.errstate(all="ignore"):                                          # least squares on those indices
        num, den = np.einsum("...j,...j->...", kv, x)[..., None], np.einsum("...j,...j->...", kv, kv)[..., None]
        refit = attempt(np.where(den > 0, num / np.where(den > 0, den, 1), cand))
    take = refit[2] < best[2]
    best = tuple(np.where(take[..., None] if a.ndim > take.ndim else take, r, a) for a, r in zip(best, refit))
    pick = (best[2].argmin(axis=0), np.arange(m))
    ds, idx, err = (a[pick] for a in best)
    zero = mx[:, 0] == 0                                                     # all zeros: d = 0
    return np.where(zero[:, None], 0.0, ds).astype(np.float32), idx, np.where(zero, 0.0, err)


# --- layouts ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LUTLayout(BlockQuantizer, BlockLayout):
    """A table type: 32-value (sub-)blocks of nibble indices into ``kvalues``
    with one float scale each. Subclasses give ``scales`` and the quantizer."""

    #: blocks quantized per numpy call: bounds the memory of the candidate searches
    chunk = 1024

    kvalues: tuple[int, ...] = KVALUES_IQ4NL

    @property
    def table(self) -> np.ndarray:
        return np.array(self.kvalues, np.int8)

    def scales(self, blocks: np.ndarray) -> np.ndarray:
        """float32 [nblocks, block / 32]: each 32-value (sub-)block's scale."""
        raise NotImplementedError

    def indices(self, blocks: np.ndarray) -> np.ndarray:
        """uint8 [nblocks, block / 32, 32]: the nibble indices, in value order."""
        at, nsub = self.at("qs"), self.block // _QB
        return np.stack([nibbles(blocks, at + 16 * s) for s in range(nsub)], axis=1)

    def dequant_blocks(self, blocks: np.ndarray) -> np.ndarray:
        v = self.table.astype(np.float32)[self.indices(blocks)]
        with np.errstate(over="ignore", invalid="ignore"):
            return (self.scales(blocks)[:, :, None] * v).reshape(-1, self.block)

    def int_blocks(self, raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, None]:
        """(d_w float32 [n, k/32], q int8 [n, k/32, 32], None): value = d_w * q,
        q the table values (``ir.int_dot``)."""
        blk = np.asarray(raw, np.uint8).reshape(-1, self.block_bytes)
        nb = k // _QB
        return self.scales(blk).reshape(n, nb), self.table[self.indices(blk)].reshape(n, nb, _QB), None

    def quantize_blocks(self, values: np.ndarray) -> np.ndarray:
        raise NotImplementedError


@dataclass(frozen=True)
class IQ4NLLayout(LUTLayout):
    def scales(self, blocks):
        return f16_at(blocks, self.at("d"))

    def quantize_blocks(self, values):
        """Per block the scale search of ``_fit_scales``, stored as float16."""
        x = _checked(self.name, values, self.block, 65504.0 * 100)
        d, idx, _ = _fit_scales(x, self.table.astype(np.float64), _to_f16)
        return np.concatenate([_f16_bytes(d), _pack_nibbles(idx)], axis=1)


@dataclass(frozen=True)
class IQ4XSLayout(LUTLayout):
    def sub_scales(self, blocks: np.ndarray) -> np.ndarray:
        """The 8 sub-block scales ls - 32, int8 [nblocks, 8]."""
        lo = blocks[:, self.at("scales_l"):self.at("scales_l") + 4]
        lo = np.stack([lo & np.uint8(15), lo >> np.uint8(4)], axis=2).reshape(-1, 8)   # nibble s % 2 of byte s // 2
        at = self.at("scales_h")
        h = blocks[:, at].astype(np.uint16) | (blocks[:, at + 1].astype(np.uint16) << np.uint16(8))
        hi = (h[:, None] >> (2 * np.arange(8, dtype=np.uint16))) & np.uint16(3)          # bits 2s, 2s + 1
        return (lo.astype(np.int8) | (hi.astype(np.int8) << 4)) - np.int8(32)

    def scales(self, blocks):
        return f16_at(blocks, self.at("d")) * self.sub_scales(blocks).astype(np.float32)

    def quantize_blocks(self, values):
        """Each sub-block's best real scale (``_fit_scales``, unrounded), then
        the super-block scale d: candidates put the sub-scale of largest
        magnitude on -32 or +31 (stretched a little); per candidate, each
        sub-block takes the integer ls - 32 nearest its wish or one either
        side, whichever (with its re-picked indices) errs least."""
        x = _checked(self.name, values, self.block, 65504.0 * 32 * 100)
        nb, ns = x.shape[0], self.block // _QB
        table = self.table.astype(np.float64)
        xs = x.reshape(nb, ns, _QB)
        wish, _, _ = _fit_scales(x.reshape(-1, _QB), table, lambda d: d)
        wish = wish.reshape(nb, ns).astype(np.float64)
        top = wish[np.arange(nb), np.abs(wish).argmax(axis=1)][:, None]             # [nb, 1]
        best = (np.full((nb, 1), np.inf), None, None, None)
        for end in (-32.0, -31.5, -31.0, 31.0, 30.5):
            with np.errstate(all="ignore"):
                d16 = _to_f16(top / end)                                              # [nb, 1]
                l0 = np.where(d16 != 0, np.rint(wish / d16), 0)
            errs, ls, ids = [], [], []
            for step in (-1, 0, 1):
                lv = np.clip(l0 + step, -32, 31)                                      # [nb, ns]
                dl = (d16 * lv.astype(np.float32))[:, :, None]                         # exact, as the dequantizer
                with np.errstate(all="ignore"):
                    idx = _nearest(xs / dl, table)
                errs.append(_sse(dl * table[idx].astype(np.float32), xs))
                ls.append(lv)
                ids.append(idx)
            errs, ls, ids = np.stack(errs), np.stack(ls), np.stack(ids)               # [3, nb, ns(, 32)]
            pick = errs.argmin(axis=0)
            sel = (pick, np.arange(nb)[:, None], np.arange(ns)[None, :])
            tot = errs[sel].sum(axis=1, keepdims=True)
            tot = np.where(np.isfinite(d16), tot, np.inf)
            take = tot < best[0]
            if best[1] is None:
                best = (tot, d16, ls[sel], ids[sel])
            else:
                best = (np.where(take, tot, best[0]), np.where(take, d16, best[1]),
                        np.where(take, ls[sel], best[2]), np.where(take[:, :, None], ids[sel], best[3]))
        _, d16, lv, idx = best
        zero = top[:, 0] == 0
        d16 = np.where(zero[:, None], 0.0, d16)
        u = (np.where(zero[:, None], 0, lv) + 32).astype(np.uint16)                   # 0..63
        scales_h = (((u >> 4) & 3) << (2 * np.arange(ns, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
        lo = (u & 15).astype(np.uint8)
        scales_l = lo[:, 0::2] | (lo[:, 1::2] << np.uint8(4))
        qs = _pack_nibbles(idx.reshape(-1, _QB)).reshape(nb, -1)
        return np.concatenate([_f16_bytes(d16), scales_h.astype("<u2").view(np.uint8).reshape(nb, 2), scales_l, qs],
                              axis=1)


@dataclass(frozen=True)
class MXFP4Layout(LUTLayout):
    kvalues: tuple[int, ...] = KVALUES_MXFP4

    def scales(self, blocks):
        return e8m0_half(blocks[:, self.at("e")])[:, None]

    def quantize_blocks(self, values):
        """ggml's rule: e = floor(log2 max|x|) - 2 + 127 (0 for a zero block),
        then per value the first nearest table entry (in float32)."""
        x = _checked(self.name, values, self.block, 2.0 ** 127)
        amax = np.abs(x).max(axis=1)
        with np.errstate(divide="ignore"):
            e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0)
        e = np.clip(e, 0, 254).astype(np.uint8)
        d = e8m0_half(e)[:, None, None]
        err = np.abs(d * self.table.astype(np.float32)[None, None, :] - x[:, :, None])
        idx = err.argmin(axis=2)
        return np.concatenate([e[:, None], _pack_nibbles(idx)], axis=1)
