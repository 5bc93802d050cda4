"""Repacked layouts (``ir/quant/repack.py``): a weight's blocks regrouped
W rows at a time for the integer GEMM. Repacking is lossless (unrepack gives
the file's bytes back, for any bytes, NaN scales included), the repacked
tensor dequantizes to the same floats, and the byte order is the documented
one (checked on single values, independently of the packing code)."""
from __future__ import annotations

import numpy as np
import pytest

from ir.quant import get_layout
from ir.quant.repack import REPACKABLE, WIDTHS, base_layout, can_repack, repacked_name, split_repacked
from runtime.tools.kernel_lab import make_weight

SHAPES = [(16, 256), (48, 512), (32, 768)]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("base", REPACKABLE)
def test_repack_round_trip_any_bytes(base: str, width: int) -> None:
    rng = np.random.default_rng(1)
    lay = get_layout(repacked_name(base, width))
    for rows, cols in SHAPES:
        n = get_layout(base).nbytes((rows, cols))
        raw = rng.integers(0, 256, n, dtype=np.uint8)
        packed = lay.repack(raw, rows, cols)
        assert packed.nbytes == lay.nbytes((rows, cols))
        np.testing.assert_array_equal(lay.unrepack(packed, rows, cols), raw)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("base", REPACKABLE)
def test_repacked_dequantizes_to_the_same_floats(base: str, width: int) -> None:
    rng = np.random.default_rng(2)
    w = make_weight(rng, base, 32, 512)
    lay = get_layout(repacked_name(base, width))
    packed = lay.repack(np.asarray(w.raw), 32, 512)
    want = get_layout(base).dequantize(np.asarray(w.raw), (32, 512))
    np.testing.assert_array_equal(lay.dequantize(packed, (32, 512)), want)
    np.testing.assert_array_equal(lay.dequantize_rows(packed, (32, 512), np.array([3, 17])), want[[3, 17]])


def _vector_byte(width: int, r: int, c: int) -> int:
    return 4 * r + c


@pytest.mark.parametrize("width", WIDTHS)
def test_q5_0_byte_order(width: int) -> None:
    """One row's fifth bit of value 4i + c lands in bit 4r + c of mask i;
    quant byte 4v + c of row r is byte 4r + c of vector v; d follows."""
    rows, cols, W = width, 32, width
    raw = np.zeros((rows, 22), np.uint8)
    r, i, c = W - 3, 5, 2
    val = 4 * i + c
    raw[r, 2 + val // 8] = 1 << (val % 8)          # qh: bit val of row r
    raw[r, 6 + 4 * 3 + 1] = 0xA7                    # quant byte 13 = 4 * 3 + 1
    raw[r, 0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    t = get_layout(repacked_name("Q5_0", W)).repack(raw.reshape(-1), rows, cols)
    assert t[4 * W * 3 + _vector_byte(W, r, 1)] == 0xA7 and np.count_nonzero(t[:16 * W]) == 1
    masks = t[16 * W:20 * W]
    bit = 4 * r + c
    assert masks[i * W // 2 + bit // 8] == 1 << (bit % 8) and np.count_nonzero(masks) == 1
    assert t[20 * W:22 * W].view("<f2")[r] == 0.5


@pytest.mark.parametrize("width", WIDTHS)
def test_q6_k_byte_order(width: int) -> None:
    """Value 64g + 32h + 4i + c of row r: its low 4 bits in nibble vector i
    of group g, low nibble for h = 0, high for h = 1; its bits 4, 5 at bits
    2t of the group's high vector k with 4k + t = 8h + i."""
    W = width
    g, h, i, c, r = 2, 1, 6, 3, 1
    val = 64 * g + 32 * h + 4 * i + c
    blk = np.zeros(210, np.uint8)
    # Q6_K value 128H + 32I + l: low 4 bits in ql[64H + l + 32 (I % 2)] (nibble I // 2), high in qh[32H + l] bits 2I
    H, rest = divmod(val, 128)
    I, l = divmod(rest, 32)
    blk[64 * H + 32 * (I % 2) + l] = 0x9 << (4 * (I // 2))
    blk[128 + 32 * H + l] = 0x2 << (2 * I)
    raw = np.zeros((W, 210), np.uint8)
    raw[r] = blk
    t = get_layout(repacked_name("Q6_K", W)).repack(raw.reshape(-1), W, 256)
    groups = t[20 * W:].reshape(4, 48 * W)
    nib = groups[:, :32 * W].reshape(4, 8, 4 * W)
    assert nib[g, i, _vector_byte(W, r, c)] == 0x9 << (4 * h)
    assert np.count_nonzero(nib) == 1
    hv = groups[:, 32 * W:].reshape(4, 4, 4 * W)
    k, tt = divmod(8 * h + i, 4)
    assert hv[g, k, _vector_byte(W, r, c)] == 0x2 << (2 * tt)
    assert np.count_nonzero(hv) == 1


def test_names_and_eligibility() -> None:
    assert split_repacked("Q5_0x16") == ("Q5_0", 16) and split_repacked("Q5_0") is None
    assert split_repacked("Q2_Kx16") is None and split_repacked("Q5_0x4") is None
    assert base_layout("Q4_Kx8") == "Q4_K" and base_layout("F32") == "F32"
    assert can_repack("Q4_K", 32, 512, 16) and not can_repack("Q4_K", 24, 512, 16)
    assert not can_repack("Q4_K", 32, 288, 16) and not can_repack("Q2_K", 32, 512, 16)
    with pytest.raises(ValueError, match="no 16-row repacked form"):
        get_layout("Q8_0x16").nbytes((24, 64))
