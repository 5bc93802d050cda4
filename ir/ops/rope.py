"""Rotary position embeddings (``rope``); the tables: ``ir.rope_tables``."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..rope_tables import rope_tables_at
from ..types import TensorType
from .registry import f32_of, need, register


def rope_type(ts: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    need(len(ts) in (2, 3), f"rope takes x, pos and optionally frequency factors, got {len(ts)} operands")
    x, pos = ts[0], ts[1]
    hd = attrs["head_dim"]
    need(int(x.shape[-1]) % hd == 0 and hd % 2 == 0, f"rope: head_dim {hd} does not fit {x}")
    need(attrs.get("style") in ("interleaved", "neox"), f"rope: unknown style {attrs.get('style')!r}")
    need(pos.dtype == "i32" and (pos.rank == 0 or (pos.rank == 1 and x.rank == 2 and pos.shape[0] == x.shape[0])),
          f"rope: pos must be an i32 scalar or one i32 position per row of {x}, got {pos}")
    if len(ts) == 3:
        ff = ts[2]
        need(ff.rank == 1 and (ff.layout or "F32") == "F32", f"rope: frequency factors must be F32, got {ff}")
    need(float(attrs.get("freq_scale", 1.0)) > 0, "rope: freq_scale must be positive")
    rot = attrs.get("dims") or hd
    need(isinstance(rot, int) and 0 < rot <= hd and rot % 2 == 0, f"rope: dims {rot} must be even, 1..{hd}")
    if len(ts) == 3:
        need(ts[2].shape[0] == rot // 2, f"rope: {rot // 2} frequency factors needed, got {ts[2]}")
    return TensorType(x.shape, "f32")


@register("rope", -1, rope_type)
def rope_ref(x: np.ndarray, pos: Any, freq_factors: Any = None, *, head_dim: int, theta: float, style: str,
             dims: int | None = None, **scaling: Any) -> np.ndarray:
    """Rotary position embedding. ``interleaved`` rotates (x[2i], x[2i+1]) as
    llama2.c and GGUF llama; ``neox`` rotates (x[i], x[i + head_dim/2]).
    Row t sits at position pos + t, or with ``pos`` a vector (a batch of
    sequences) at pos[t]. ``freq_factors`` (a weight, Llama 3's
    ``rope_freqs``) and the scaling attributes (``ROPE_SCALING_DEFAULTS``)
    are described in ``rope_tables_at``. ``dims`` (partial rotary, Phi-2):
    only each head's first ``dims`` values rotate, as a head of that size
    would (its own frequencies); the rest pass through."""
    x = np.asarray(x, np.float32)
    lead = x.shape[:-1]
    t = x.reshape(-1, x.shape[-1])
    n_rows = t.shape[0]
    rot = int(dims or head_dim)
    ff = None if freq_factors is None else f32_of(freq_factors)
    at = np.asarray(pos, np.int64).reshape(n_rows) if np.ndim(pos) == 1 else np.arange(int(pos), int(pos) + n_rows)
    cos, sin = rope_tables_at(at, rot, theta, freq_factors=ff, attrs=scaling)
    heads = t.reshape(n_rows, -1, head_dim)[..., :rot]
    if style == "interleaved":
        a, b = heads[..., 0::2], heads[..., 1::2]
    else:
        a, b = heads[..., : rot // 2], heads[..., rot // 2:]
    c, s = cos[:, None, :], sin[:, None, :]
    ra, rb = a * c - b * s, a * s + b * c
    out = t.reshape(n_rows, -1, head_dim).copy()
    if style == "interleaved":
        out[..., 0:rot:2], out[..., 1:rot:2] = ra, rb
    else:
        out[..., : rot // 2], out[..., rot // 2: rot] = ra, rb
    return out.reshape(lead + (x.shape[-1],))
