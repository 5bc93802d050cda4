"""Which low-bit key scheme keeps perplexity: a study, not lmc's code path.

    python scripts/kv_keys_study.py MODEL.gguf TEXT [--window 2048] [--windows 4]
        [--variants f32,q4,q4+sink,q4+sink+recent32 ...]

A float32 numpy forward of a llama or qwen2 GGUF (weights dequantized by
gguf.quants), each window from position 0, every position scored, with the
KV cache's rounding simulated between the projections and attention, so a
scheme can be judged before kernels are written for it. Its f32 logits
stay within ~1 of lmc's (lmc's matmuls take int8 activations); compare
variants with each other, in one run.

Variants (``+`` combines):
* ``f32``: no rounding (the baseline the others are measured against);
* ``q4``: lmc's ``--kv-type q4``: keys minus their mean (lmc calibrates it
  on a built-in text; here the window's own), then every head turned by the
  normalized Walsh-Hadamard transform, groups of 32 with an f16 step and
  minimum, turned back; values the same without the mean;
* ``k5``, ``k8``: keys with 5 or 8 bits, values 4;
* ``exactv``: values not rounded (what the keys alone cost);
* ``smooth``: keys divided per channel by sqrt(std(k) / rms(q)) before the
  turn and multiplied back after (queries would carry the factor);
* ``clip``: each group's range shrunk by the factor of 1, 0.95 ... 0.75
  that rounds it with the least squared error;
* ``sink``: position 0's key and value read exactly;
* ``recentN``: each query row reads the N positions up to its own exactly
  (relative to the row, so a token's numbers do not depend on how the rows
  were batched).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ir.kv_lowbit import fwht  # noqa: E402


class Model:
    """The weights and shapes of a llama / qwen2 GGUF, dequantized to float32."""

    def __init__(self, path: str) -> None:
        from gguf import GGUFReader
        from gguf.quants import dequantize

        r = GGUFReader(path)
        f = r.fields

        def get(k: str):
            return f[k].parts[f[k].data[0]]
        self.arch = arch = bytes(get("general.architecture")).decode()
        if arch not in ("llama", "qwen2"):
            raise SystemExit(f"{path}: a {arch} model; this study reads llama and qwen2")
        self.L = int(get(f"{arch}.block_count")[0])
        self.D = int(get(f"{arch}.embedding_length")[0])
        self.H = int(get(f"{arch}.attention.head_count")[0])
        self.KVH = int(get(f"{arch}.attention.head_count_kv")[0])
        self.hd = self.D // self.H
        self.base = float(get(f"{arch}.rope.freq_base")[0])
        self.eps = float(get(f"{arch}.attention.layer_norm_rms_epsilon")[0])
        self.neox = arch == "qwen2"   # llama.cpp's rope type for each
        self.W = {}
        for t in r.tensors:
            w = dequantize(t.data, t.tensor_type).astype(np.float32)
            self.W[t.name] = w.reshape([int(d) for d in reversed(t.shape)]) if w.ndim == 1 and len(t.shape) > 1 else w
        self.W.setdefault("output.weight", self.W["token_embd.weight"])

    def rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        hd = self.hd
        ang = np.outer(pos, self.base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd))
        c, s = np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]
        if self.neox:
            a, b = x[..., :hd // 2], x[..., hd // 2:]
            return np.concatenate([a * c - b * s, a * s + b * c], -1)
        out = np.empty_like(x)
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out

    def norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w


def rounded(x: np.ndarray, hd: int, bits: int = 4, shrink: tuple[float, ...] = (1.0,)) -> np.ndarray:
    """[T, KVH, hd] as a rotated low-bit cache gives it back (``ir.kv_lowbit``'s
    rounding: f16 step and minimum per group of 32, codes rounded to nearest)."""
    r = fwht(x.reshape(-1, hd), hd).reshape(-1, 32)
    lo, hi = r.min(-1, keepdims=True), r.max(-1, keepdims=True)
    top = (1 << bits) - 1
    best = err = None
    for f in shrink:
        mid = (lo + hi) / 2
        a, z = mid - (mid - lo) * f, mid + (hi - mid) * f
        d = ((z - a) / top).astype(np.float16).astype(np.float32)
        m = a.astype(np.float16).astype(np.float32)
        inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0)
        y = np.clip(np.rint((r - m) * inv), 0, top) * d + m
        e = ((y - r) ** 2).sum(-1, keepdims=True)
        if best is None:
            best, err = y, e
        else:
            best, err = np.where(e < err, y, best), np.minimum(e, err)
    return fwht(best.reshape(-1, hd), hd).reshape(x.shape)


def cache_of(variant: str, k: np.ndarray, v: np.ndarray, q: np.ndarray, hd: int, kvh: int):
    """What attention reads for this variant: (keys, values, exact keys, exact values)."""
    if variant == "f32":
        return k, v, k, v
    parts = set(variant.split("+"))
    mu = k.mean(0, keepdims=True)
    kk = k - mu
    bits = 5 if "k5" in parts else 8 if "k8" in parts else 4
    shrink = (1.0, .95, .9, .85, .8, .75) if "clip" in parts else (1.0,)
    if "smooth" in parts:
        sk = kk.std(0, keepdims=True) + 1e-6
        qr = np.sqrt((q.reshape(q.shape[0], kvh, -1, hd) ** 2).mean((0, 2)))[None] + 1e-6
        s = np.sqrt(sk / qr)
        s = s / np.exp(np.log(s).mean(-1, keepdims=True))
        kq = rounded(kk / s, hd, bits, shrink) * s + mu
    else:
        kq = rounded(kk, hd, bits, shrink) + mu
    vq = v if "exactv" in parts else rounded(v, hd)
    return kq, vq, k, v


def exact_mask(variant: str, T: int) -> np.ndarray | None:
    """[T, T]: which (query row, position) pairs read the exact rows."""
    sink = recent = 0
    for p in variant.split("+"):
        if p == "sink":
            sink = 1
        elif p.startswith("recent"):
            recent = int(p[6:])
    if not (sink or recent):
        return None
    pos = np.arange(T)
    dist = pos[:, None] - pos[None, :]
    m = (dist >= 0) & (dist < recent)
    m[:, :sink] = True
    return m


def window_logits(M: Model, ids: np.ndarray, variant: str) -> np.ndarray:
    W, T = M.W, len(ids)
    x = W["token_embd.weight"][ids]
    pos = np.arange(T)
    causal = np.triu(np.full((T, T), -np.inf, np.float32), 1)
    exact = exact_mask(variant, T)
    g = M.H // M.KVH
    for layer in range(M.L):
        p = f"blk.{layer}."
        h = M.norm(x, W[p + "attn_norm.weight"])
        q, k, v = (h @ W[p + f"attn_{n}.weight"].T + W.get(p + f"attn_{n}.bias", 0) for n in "qkv")
        q = M.rope(q.reshape(T, M.H, M.hd), pos)
        k = M.rope(k.reshape(T, M.KVH, M.hd), pos)
        v = v.reshape(T, M.KVH, M.hd)
        kq, vq, ke, ve = cache_of(variant, k, v, q, M.hd, M.KVH)
        o = np.empty((T, M.H, M.hd), np.float32)
        for hh in range(M.H):
            kv = hh // g
            s = q[:, hh, :] @ kq[:, kv, :].T
            if exact is not None:
                s = np.where(exact, q[:, hh, :] @ ke[:, kv, :].T, s)
            s = s / np.float32(math.sqrt(M.hd)) + causal
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            if exact is None:
                o[:, hh, :] = s @ vq[:, kv, :]
            else:
                o[:, hh, :] = np.where(exact, s, 0) @ ve[:, kv, :] + np.where(exact, 0, s) @ vq[:, kv, :]
        x = x + o.reshape(T, -1) @ W[p + "attn_output.weight"].T
        h = M.norm(x, W[p + "ffn_norm.weight"])
        a = h @ W[p + "ffn_gate.weight"].T
        x = x + ((a / (1 + np.exp(-a))) * (h @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
    return M.norm(x, W["output_norm.weight"]) @ W["output.weight"].T


def nll(logits: np.ndarray, ids: np.ndarray) -> float:
    lg = logits[:-1].astype(np.float64)
    m = lg.max(-1, keepdims=True)
    lse = np.log(np.exp(lg - m).sum(-1)) + m[:, 0]
    return float((lse - lg[np.arange(len(ids) - 1), ids[1:]]).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("text")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--variants", default="f32,q4,q4+sink,q4+sink+recent32")
    a = ap.parse_args()
    import runtime

    ids = np.array(runtime.load(a.model, backend="interp").encode(Path(a.text).read_text(), bos=True))
    M = Model(a.model)
    n = min(a.windows, len(ids) // a.window)
    print(f"{len(ids)} tokens, {n} windows of {a.window}")
    base = None
    for variant in a.variants.split(","):
        t0, total = time.time(), 0.0
        for w in range(n):
            part = ids[w * a.window:(w + 1) * a.window]
            total += nll(window_logits(M, part, variant), part)
        ppl = math.exp(total / (n * (a.window - 1)))
        base = base or ppl
        print(f"{variant:24s} perplexity {ppl:8.4f}  {100 * (ppl / base - 1):+6.2f}%  ({time.time() - t0:.0f} s)",
              flush=True)


if __name__ == "__main__":
    main()
