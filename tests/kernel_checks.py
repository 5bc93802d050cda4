"""Shared assertion for compiled matmul kernels against their references."""
from __future__ import annotations

import numpy as np

from ir.ops import WeightData


def check_dot(got: np.ndarray, want: np.ndarray, x: np.ndarray, w: WeightData, floor: float = 1e-37) -> None:
    """Equal up to float32 rounding of a dot product: error relative to
    sum |x||w| (the scale of the terms, which cancellation does not shrink)."""
    wf = w.to_f32().astype(np.float64)
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(wf).T
    assert got.shape == want.shape
    assert np.all(np.isfinite(got)), got
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    bad = err > 1e-5 * scale + floor
    assert not bad.any(), (np.argwhere(bad)[:5], got[bad][:5], want[bad][:5], scale[bad][:5])
