"""How exact must a prompt's attention be: a study, not lmc's code path.

    python scripts/attention_precision_study.py MODEL.gguf TEXT [--tokens 1152] [--rows 128] [--every 8]

Without AMX, a prompt's attention runs on float32 multiply-adds (16 a
vector instruction). Integer or bfloat16 dot products do 32 (``vpdpwssd``,
``vdpbf16ps``; 64 for ``vpdpbusd``), so they could halve its time, if
their rounding is small enough. This runs the model through lmc's
interpreter (float32 numpy, the f16 KV cache as lmc keeps it), records
every layer's queries and cache, and for the last ``--rows`` rows (every
``--every``-th) computes the attention output in float64 and in variants:

* ``f32``: lmc's own output (the reference float32 path);
* ``qk16``: Q.K^T on integers: each query row and each key row of a head
  scaled to 13-bit integers (4095: 64 products of two of them fit int32),
  ``vpdpwssd``'s arithmetic; P.V in float64;
* ``qk16rot``: the same after a normalized Walsh-Hadamard turn of queries
  and keys (q.k unchanged; outliers spread over the head);
* ``k16rot``, ``q16rot``: only the keys, only the queries rounded so;
* ``pv_bf16``: exact scores, P and V rounded to bfloat16 (``vdpbf16ps``),
  the sum of the rounded weights as the divisor;
* ``int8_out``: the exact output rounded as the output projection's int8
  activations are (blocks of 32): the error lmc's integer path adds
  anyway, for scale.

Printed per layer: the largest error over the rows, relative to the rms of
the exact output.

Found on Qwen2.5-Coder-0.5B (``ir/ops/*.py`` as text, 1,152 tokens, rows
1,024-1,151): ``pv_bf16`` errs 1.1-3.4% against ``int8_out``'s 2.4-4.5%
in every layer (below what the integer path adds next), but ``qk16`` errs
23% in layer 0 and 2-5% in others, ``qk16rot`` 14% in layer 0, nearly all
of it the keys' rounding (``k16rot`` 14%, ``q16rot`` 3.2%): layer 0's
peaked scores take no 13-bit keys. So only P.V, half of the arithmetic,
may leave float32 on such a CPU: at most ~1.3x on a prompt's attention.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import runtime  # noqa: E402
from ir.kv_lowbit import fwht  # noqa: E402
from ir.ops.registry import OPS  # noqa: E402

VARIANTS = ("f32", "qk16", "qk16rot", "k16rot", "q16rot", "pv_bf16", "int8_out")


def record(model: str, text: str, tokens: int) -> tuple[list, dict]:
    """Per layer (q, k cache, v cache, lmc's output) of one prompt, and the model's shape."""
    calls: list = []
    ref = OPS["attention"].ref

    def spy(q, kc, vc, pos, *rest, **kw):
        out = ref(q, kc, vc, pos, *rest, **kw)
        calls.append((np.array(q), np.array(kc), np.array(vc), int(pos), np.array(out)))
        shape.update(kw)
        return out
    shape: dict = {}
    OPS["attention"] = dataclasses.replace(OPS["attention"], ref=spy)
    try:
        m = runtime.load(model, backend="interp", ctx=max(tokens, 256))
        ids = m.encode(text, bos=True)[:tokens]
        if len(ids) < tokens:
            raise SystemExit(f"{model}: the text is {len(ids)} tokens, fewer than --tokens {tokens}")
        m.logits(ids)
    finally:
        OPS["attention"] = dataclasses.replace(OPS["attention"], ref=ref)
    return calls, shape


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16 (nearest even), as float32."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def int13(x: np.ndarray, turn: bool) -> np.ndarray:
    """Rows of x (turned first if asked) rounded to 13-bit integers times their row's step."""
    x = np.asarray(x, np.float64)
    if turn:
        x = fwht(x.astype(np.float32), x.shape[-1]).astype(np.float64)
    step = np.abs(x).max(axis=-1, keepdims=True) / 4095
    step[step == 0] = 1
    return np.round(x / step) * step


def turned(x: np.ndarray, turn: bool) -> np.ndarray:
    return fwht(np.asarray(x, np.float32), x.shape[-1]).astype(np.float64) if turn else np.asarray(x, np.float64)


def weighted(s: np.ndarray, v: np.ndarray, low: bool) -> np.ndarray:
    p = np.exp(s - s.max())
    if low:
        p = bf16(p).astype(np.float64)
        v = bf16(v.astype(np.float32)).astype(np.float64)
    return p @ v / p.sum()


def errors(calls: list, shape: dict, rows: int, every: int) -> list[dict[str, float]]:
    H, KVH, hd, scale = shape["n_heads"], shape["n_kv_heads"], shape["head_dim"], shape["scale"]
    per_layer = []
    for q, kc, vc, pos, out in calls:
        T = q.shape[0]
        worst = dict.fromkeys(VARIANTS, 0.0)
        for t in range(max(0, T - rows), T, every):
            n = pos + t + 1
            K = kc[:n].astype(np.float64).reshape(n, KVH, hd)
            V = vc[:n].astype(np.float64).reshape(n, KVH, hd)
            qt = q[t].reshape(H, hd).astype(np.float64)
            got = {k: np.empty((H, hd)) for k in VARIANTS}
            exact = np.empty((H, hd))
            for h in range(H):
                g = h // (H // KVH)
                exact[h] = weighted(K[:, g] @ qt[h] * scale, V[:, g], False)
                for name, kq, qq, turn in (("qk16", True, True, False), ("qk16rot", True, True, True),
                                           ("k16rot", True, False, True), ("q16rot", False, True, True)):
                    kk = int13(K[:, g], turn) if kq else turned(K[:, g], turn)
                    qv = int13(qt[h], turn) if qq else turned(qt[h], turn)
                    got[name][h] = weighted(kk @ qv * scale, V[:, g], False)
                got["pv_bf16"][h] = weighted(K[:, g] @ qt[h] * scale, V[:, g], True)
            got["f32"] = out[t].reshape(H, hd)
            blocks = exact.reshape(-1, 32)
            step = np.abs(blocks).max(axis=1, keepdims=True) / 127
            step[step == 0] = 1
            got["int8_out"] = (np.round(blocks / step) * step).reshape(H, hd)
            rms = np.sqrt((exact ** 2).mean())
            for k in VARIANTS:
                worst[k] = max(worst[k], float(np.abs(got[k] - exact).max() / rms))
        per_layer.append(worst)
    return per_layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("text")
    ap.add_argument("--tokens", type=int, default=1152, help="prompt length (default 1152)")
    ap.add_argument("--rows", type=int, default=128, help="the last rows compared (default 128)")
    ap.add_argument("--every", type=int, default=8, help="every n-th of those rows (default 8)")
    args = ap.parse_args()
    calls, shape = record(args.model, Path(args.text).read_text(encoding="utf-8"), args.tokens)
    print("layer  " + "  ".join(f"{k:>9}" for k in VARIANTS))
    for i, w in enumerate(errors(calls, shape, args.rows, args.every)):
        print(f"{i:5d}  " + "  ".join(f"{w[k]:9.1e}" for k in VARIANTS))


if __name__ == "__main__":
    main()
