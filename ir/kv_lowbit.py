"""Low-bit KV cache rows (``--kv-type q4``, ``q2``, ``q4-plain``, ``q2-plain``):
the storage format and its numpy codec, the oracle the native kernels are
tested against.

Format: groups of 32 values, each a float16 step ``d``, a float16 minimum
``m`` and 32 codes of 4 (or 2) bits; a value reads back as ``code * d + m``.
Asymmetric (a minimum, not a symmetric scale around 0), as KIVI quantizes
its 2-bit caches: with 4 or 2 levels a symmetric grid wastes a level on
whichever side of 0 a group does not reach, and keys' per-channel offsets
(and the rotation's mixing of them) leave groups far from centred. Groups
of 32 keep a group inside one head (heads are whole groups), give the
scales 1 bit (q4: 5 bits a value, 20 bytes a group) and 2 bits (q2: 3
bits a value, 12 bytes) of overhead, and are the q8 cache's block size.

Code order inside a group (so a SIMD decoder takes whole vectors with one
shift and mask): q4 is Q4_1's, byte i holds code i (low nibble) and code
i + 16 (high nibble); q2 byte i holds codes i, i + 8, i + 16, i + 24 in bits
0-1, 2-3, 4-5, 6-7.

Rotation (``q4``, ``q2``; not the ``-plain`` types): before quantizing,
each head's row of ``head_dim`` values (a power of two) is multiplied by the
normalized Walsh-Hadamard matrix H / sqrt(n), symmetric and orthogonal, so
its own inverse. It spreads a few outlier channels over the whole head, so
a group's range is set by typical values instead of the outliers, which is
what costs low-bit caches most of their accuracy (QuaRot, SpinQuant).
Attention rotates each query head the same way, so (Hq).(Hk) = q.k; the
weighted sum of rotated values is H times the true one, rotated back after.
The ``-plain`` types store the same bits without it, to measure it.

Quantization, in float32 exactly as the native kernels do it: d =
f16((max - min) / L), m = f16(min) (L = 15 or 3), then code =
clamp(rint((x - m) * (1 / d)), 0, L) with 1/d taken as 0 when d is 0.

Measured (perplexity, 2048-token windows over ~9k tokens of Python; f16 ->
q4 / q4-plain): SmolLM2-135M 6.57 -> 6.94 / 7.20, Gemma 3 270M 5.97 ->
6.63 / 6.82, Qwen2.5-Coder-0.5B 4.40 -> 14.03 / 8.10. After the rotation
every group is close to Gaussian and 4 bits leave ~7.7% relative error per
row; what hurts is the keys' position-independent part (70-85% of their
RMS in SmolLM2, a bias of RMS 35 in Qwen2.5's first layer) which takes the
range but cancels in softmax: quantizing keys minus their mean measured
0.037-0.078 relative error on the part that varies, against 0.12-0.40
with it (Qwen2.5: the rotation spreads that bias over every group of a
head, so there q4 is worse than q4-plain). So key rows are stored minus a
per-layer constant row, the key offset (``runtime.key_offsets``: the mean
of the model's post-RoPE keys over a calibration text), subtracted before
the rotation (the write's ``offset``, ``ir.ops.attention``); softmax makes
attention blind to it. Measured with it (same text): q4 6.87 / 4.58 /
6.30 (SmolLM2 / Qwen2.5 / Gemma; +4.6%, +4.2%, +5.5% over f16), q4-plain
7.11 / 5.05 / 6.60. What is left is the keys' own error: simulated in an
f32 cache on SmolLM2 (2048 tokens, windows of 512), q4 with the offset
costs +4.6%, values alone at 4 bits +0.05%; with the first position's key
kept exact (the attention sink: far from the mean, weighed heavily by most
queries) +2.8%, keys alone then +1.7%.

So beside a low-bit cache each layer keeps exact rows (f16): a query at
position p reads positions p - RECENT + 1 .. p and position 0 exactly, the
rest from the low-bit rows (``ir.ops.attention``'s ``recent``: KIVI keeps
its newest tokens in full precision, StreamingLLM its first). The window
is relative to each query row, not to a step, so a token's numbers do not
depend on how the rows were batched; the exact rows are a ring of RECENT
plus the rows of a step, and one more row keeps position 0.
``scripts/kv_keys_study.py`` simulated it first (sink + 32 recent: SmolLM2
+0.54%, Qwen2.5 +1.72%; + 128: +0.36%, +0.58%). Measured in lmc
(perplexity, 2048-token windows, no overlap, ``ir/ops/*.py``; q4 against
f16, with and without the exact rows): SmolLM2 +0.39% / +5.1%, Qwen2.5
+0.79% / +7.1%, Gemma 3 +0.79% / +7.7% (README's table has q2 and the
unrotated types).

A cache of one of these layouts is, in the interpreter, a numpy array of
one structured record per group ([rows, groups]) whose code field is named
after the layout (``KV_Q4_H64``), so the codec knows the format from the
array alone, as it knows f16 and q8 caches from their dtypes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

import numpy as np

#: values per group
GROUP = 32
#: positions a query reads exactly beside a low-bit cache: its own and the RECENT - 1 before it,
#: and position 0 (``ir.ops.attention``'s ``recent``; module docstring)
RECENT = 128
_NAME = re.compile(r"^KV_Q([24])(?:_H(\d+))?$")


@dataclass(frozen=True)
class LowBit:
    """One low-bit cache layout: bits per code and the rotation's length
    (0: none, else head_dim)."""

    bits: int
    rotate: int = 0

    @property
    def name(self) -> str:
        return f"KV_Q{self.bits}" + (f"_H{self.rotate}" if self.rotate else "")

    @property
    def levels(self) -> int:
        """L: the largest code."""
        return (1 << self.bits) - 1

    @property
    def code_bytes(self) -> int:
        return GROUP * self.bits // 8

    @property
    def group_bytes(self) -> int:
        return 4 + self.code_bytes

    @property
    def dtype(self) -> np.dtype:
        return group_dtype(self.name)


def lowbit(name: str | None) -> LowBit | None:
    """The low-bit layout of that name (``KV_Q4``, ``KV_Q2_H64``), or None."""
    m = _NAME.match(name or "")
    if not m:
        return None
    n = int(m.group(2) or 0)
    if m.group(2) is not None and (n < GROUP or n & (n - 1)):
        return None
    return LowBit(int(m.group(1)), n)


@cache
def group_dtype(name: str) -> np.dtype:
    """The interpreter's record of one group (module docstring)."""
    f = lowbit(name)
    assert f is not None, name
    return np.dtype([("d", "<f2"), ("m", "<f2"), (name, "u1", (f.code_bytes,))])


def of_array(cache_arr: np.ndarray) -> LowBit | None:
    """The layout of an interpreter cache array, None for f32/f16/q8."""
    names = cache_arr.dtype.names
    return lowbit(names[2]) if names and len(names) == 3 else None


def fwht(x: np.ndarray, n: int) -> np.ndarray:
    """x's last axis in pieces of n (a power of two), each times H / sqrt(n):
    log2(n) butterfly stages (a + b, a - b) at distance 1, 2, 4, ... then one
    multiply by float32(1 / sqrt(n)), all in float32 as the kernels do it."""
    x = np.asarray(x, np.float32)
    shape = x.shape
    y = x.reshape(-1, n).copy()
    h = 1
    while h < n:
        v = y.reshape(-1, n // (2 * h), 2, h)
        a, b = v[:, :, 0, :].copy(), v[:, :, 1, :].copy()
        v[:, :, 0, :] = a + b
        v[:, :, 1, :] = a - b
        h *= 2
    return (y * np.float32(1.0 / np.sqrt(n))).reshape(shape)


def encode(rows: np.ndarray, f: LowBit) -> np.ndarray:
    """float32 [n, D] -> records [n, D / 32] (rotated first if the layout says so)."""
    rows = np.asarray(rows, np.float32)
    n, D = rows.shape
    x = fwht(rows, f.rotate) if f.rotate else rows
    g = x.reshape(n, D // GROUP, GROUP)
    lo, hi = g.min(-1), g.max(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        d = ((hi - lo) / np.float32(f.levels)).astype(np.float16)
        m = lo.astype(np.float16)
        df = d.astype(np.float32)
        inv = np.where(df > 0, np.float32(1) / np.where(df > 0, df, np.float32(1)), np.float32(0)).astype(np.float32)
        q = np.rint((g - m.astype(np.float32)[..., None]) * inv[..., None])
        codes = np.clip(np.nan_to_num(q, nan=0.0), 0, f.levels).astype(np.uint8)
    out = np.empty((n, D // GROUP), f.dtype)
    out["d"], out["m"] = d, m
    out[f.name] = pack(codes, f.bits)
    return out


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """[..., 32] codes -> [..., 32 * bits / 8] bytes in the module's order."""
    per = 8 // bits
    step = GROUP // per
    out = np.zeros(codes.shape[:-1] + (step,), np.uint8)
    for k in range(per):
        out |= (codes[..., k * step:(k + 1) * step] << (k * bits)).astype(np.uint8)
    return out


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """``pack``'s inverse: [..., bytes] -> [..., 32] codes."""
    per = 8 // bits
    mask = (1 << bits) - 1
    return np.concatenate([(packed >> (k * bits)) & mask for k in range(per)], axis=-1)


def decode(part: np.ndarray) -> np.ndarray:
    """Records [n, groups] -> float32 [n, groups * 32], code * d + m in float32.
    The values as stored: still rotated for a rotated layout (attention
    rotates the queries instead); ``unrotated`` undoes it."""
    f = of_array(part)
    assert f is not None
    codes = unpack(part[f.name], f.bits).astype(np.float32)
    d = part["d"].astype(np.float32)[..., None]
    m = part["m"].astype(np.float32)[..., None]
    return (codes * d + m).reshape(part.shape[0], -1)


def unrotated(part: np.ndarray) -> np.ndarray:
    """Records -> the float32 values they stand for (rotation undone)."""
    f = of_array(part)
    assert f is not None
    x = decode(part)
    return fwht(x, f.rotate) if f.rotate else x
