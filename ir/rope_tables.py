"""RoPE's cos/sin tables, with the scalings llama.cpp applies (Llama 3's
frequency factors, linear, YaRN), in float32 one operation at a time so the
native kernel can round exactly alike (``compiler/codegen/k_norm_rope.py``)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np


#: attributes of ``rope`` that scale it (absent: no scaling), with their defaults
ROPE_SCALING_DEFAULTS = {"freq_scale": 1.0, "ext_factor": 0.0, "attn_factor": 1.0, "yarn_orig_ctx": 0,
                         "beta_fast": 32.0, "beta_slow": 1.0}


def rope_base_freqs(head_dim: int, theta: float) -> np.ndarray:
    """freq_i = 1 / theta^(2i/head_dim), float32 as run.c computes it."""
    i2 = np.arange(0, head_dim, 2, dtype=np.float32)
    return np.float32(1.0) / np.power(np.float32(theta), i2 / np.float32(head_dim))


def yarn_corr_dims(n_dims: int, orig_ctx: int, theta: float, beta_fast: float, beta_slow: float
                   ) -> tuple[float, float]:
    """The frequency-pair indices between which YaRN ramps from extrapolation
    to interpolation (llama.cpp's ggml_rope_yarn_corr_dims, in float32)."""
    def dim(beta: float) -> float:
        return float(np.float32(n_dims) * np.log(np.float32(orig_ctx) / (np.float32(beta) * np.float32(2) * np.float32(math.pi)),
                                                  dtype=np.float32)
                     / (np.float32(2) * np.log(np.float32(theta), dtype=np.float32)))

    lo = math.floor(dim(beta_fast))
    hi = math.ceil(dim(beta_slow))
    return float(max(0, lo)), float(min(n_dims - 1, hi))


def rope_mix(head_dim: int, theta: float, attrs: dict[str, Any]) -> tuple[np.ndarray | None, np.float32]:
    """YaRN's per-pair extrapolation weight (None without YaRN) and the
    magnitude factor applied to cos and sin, both float32.

    YaRN blends, per frequency pair i, the interpolated angle (times
    ``freq_scale``) with the original one by ``ramp(i) * ext_factor``, and
    scales cos/sin by ``attn_factor * (1 + 0.1 ln(1/freq_scale))``; without
    ``ext_factor`` only ``attn_factor`` applies (llama.cpp's rope_yarn)."""
    a = {**ROPE_SCALING_DEFAULTS, **{k: v for k, v in attrs.items() if k in ROPE_SCALING_DEFAULTS}}
    ext = np.float32(a["ext_factor"])
    mscale = np.float32(a["attn_factor"])
    if ext == 0:
        return None, mscale
    lo, hi = yarn_corr_dims(head_dim, int(a["yarn_orig_ctx"]), theta, float(a["beta_fast"]),
                            float(a["beta_slow"]))
    i = np.arange(head_dim // 2, dtype=np.float32)
    y = (i - np.float32(lo)) / np.float32(max(0.001, hi - lo))
    ramp = (np.float32(1) - np.clip(y, 0, 1)).astype(np.float32)
    mix = (ramp * ext).astype(np.float32)
    fs = np.float32(a["freq_scale"])
    mscale = np.float32(mscale * (np.float32(1) + np.float32(0.1) * np.log(np.float32(1) / fs, dtype=np.float32)))
    return mix, mscale


def rope_tables(n_pos: int, pos: int, head_dim: int, theta: float, dims: int | None = None,
                freq_factors: np.ndarray | None = None, attrs: dict[str, Any] | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [n_pos, rot/2] for positions pos..pos+n_pos-1 (``rope_tables_at``)."""
    return rope_tables_at(np.arange(pos, pos + n_pos), head_dim, theta, dims, freq_factors, attrs)


def rope_tables_at(positions: np.ndarray, head_dim: int, theta: float, dims: int | None = None,
                   freq_factors: np.ndarray | None = None, attrs: dict[str, Any] | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [len(positions), rot/2] in float32 as run.c:
    freq_i = 1 / theta^(2i/head_dim), angle = position * freq_i.

    Scaling as llama.cpp applies it: the angle divided by the pair's
    frequency factor (Llama 3's ``rope_freqs``), times ``freq_scale``
    (linear: 1/factor), blended with the unscaled angle by YaRN's ramp; cos
    and sin times the magnitude factor. Each step is one float32 operation,
    in this order, so the native kernel can round exactly alike."""
    rot = dims or head_dim
    freq = rope_base_freqs(head_dim, theta)[: rot // 2]
    p = np.asarray(positions).astype(np.float32)
    ang = (p[:, None] * freq[None, :]).astype(np.float32)
    attrs = attrs or {}
    if freq_factors is not None:
        ang = (ang / np.asarray(freq_factors, np.float32)[None, : rot // 2]).astype(np.float32)
    fs = np.float32(attrs.get("freq_scale", 1.0))
    mix, mscale = rope_mix(head_dim, theta, attrs)
    if fs != 1 or mix is not None:
        interp = (fs * ang).astype(np.float32)
        if mix is not None:
            m = mix[None, : rot // 2]
            ang = (interp * (np.float32(1) - m) + ang * m).astype(np.float32)
        else:
            ang = interp
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    if mscale != 1:
        cos, sin = (cos * mscale).astype(np.float32), (sin * mscale).astype(np.float32)
    return cos, sin
