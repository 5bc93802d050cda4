"""GGUF's table types: 4-bit indices into a 16-entry table of int8 values
(IQ4_NL, MXFP4), as llama.cpp stores them.

    type     bytes  block                                           value j
    IQ4_NL   18     [d f16][16 x nibble pairs]                      d * K[i_j]
    MXFP4    17     [e u8][16 x nibble pairs]                       K[i_j] * 2^(e - 128)

``K`` is the type's table: ``KVALUES_IQ4NL`` (a non-linear 4-bit code, dense
near zero) for IQ4_NL, ``KVALUES_MXFP4`` (the E2M1 values of OCP's
microscaling format, doubled so they are integers) for MXFP4. Nibbles come
as in Q4_0: the low nibbles of 16 bytes are values 0..15 of a 32-value
block, the high nibbles values 16..31. MXFP4's scale is E8M0, a bare
exponent byte; ggml reads it halved (``GGML_E8M0_TO_FP32_HALF``: 2^(e-128),
float32 subnormal for e < 2), because the table holds doubled values.

The dequantizers compute in float32 in ggml's order, so they agree with it
bit for bit: ``d * K`` (IQ4_NL); ``2^(e-128) * K`` (MXFP4; exact unless it
overflows to inf).

The integer path (``ir.int_dot``, ``act="q8"``, ``int_blocks``): the
weight's integer quants are the table values ``K[i]`` themselves (int8) and
its block scale d_w is ``d`` or ``2^(e-128)``; no offset. The kernels make
them unsigned as ``K[i] + zero`` (the type's row) with one byte lookup of
the table plus ``zero``.

``quantize`` (float32 [rows, cols] -> stored bytes): IQ4_NL searches the
scale that minimises the squared error of the stored block (llama.cpp's
``quantize_row_iq4_nl`` idea: the largest value placed on each end of the
table with a few stretches, then a least-squares refit; written here for
numpy, errors measured with the rounded, stored scale); MXFP4 picks ggml's
exponent (``floor(log2 max|x|) - 2``, so 12 * 2^(e-128) covers max|x| to
within 25%) and the nearest table value per element, which is what
``gguf.quants.quantize`` writes, byte for byte.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import BlockLayout
from .gguf import f16_at, nibbles

#: IQ4_NL's table (ggml's ``kvalues_iq4nl``), ascending
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
#: MXFP4's table (ggml's ``kvalues_mxfp4``): E2M1 code c -> twice its value
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

#: values per nibble block
_QB = 32
#: blocks quantized per numpy call: bounds the candidate searches' memory
_CHUNK = 1024
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
class LUTLayout(BlockLayout):
    """A table type: 32-value (sub-)blocks of nibble indices into ``kvalues``
    with one float scale each. Subclasses give ``scales`` and the quantizer."""

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

    def quantize(self, matrix: np.ndarray) -> np.ndarray:
        """float32 [rows, cols] -> the stored bytes of the whole tensor (uint8), blocks in row-major order."""
        m = np.asarray(matrix, np.float32)
        cols = m.shape[-1] if m.ndim else 1
        if m.ndim == 0 or cols % self.block:
            raise ValueError(f"{self.name}: {cols} columns are not a multiple of the block size {self.block}")
        blocks = np.ascontiguousarray(m).reshape(-1, self.block)
        out = np.empty((blocks.shape[0], self.block_bytes), np.uint8)
        for s in range(0, blocks.shape[0], _CHUNK):
            out[s:s + _CHUNK] = self.quantize_blocks(blocks[s:s + _CHUNK])
        return out.reshape(-1)


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
