"""Key offsets of a low-bit KV cache: one constant row per layer, what the
key writes subtract before quantizing (``KEY_OFFSET_KV_TYPES``).

Keys carry a large part that is the same at every position (70-85% of
their RMS in SmolLM2; a bias of RMS 35 in Qwen2.5's first layer). Softmax
cancels it, but a group of 4 or 2 bits spends its range on it, and the
Hadamard turn spreads it over every group of a head. Keys are stored after
RoPE, so subtracting any constant row m from every stored key of a layer
changes each score q.k by q.m, the same for every position one query sees:
attention is unchanged and reads the rows as stored (``ir.ops.attention``).
Only the writes change, and m must be a model constant, never a
sequence's: prefix sharing, rewinds and a drafter sharing the cache stay
exact because every row of a layer is stored against the same m.

m is the mean of each layer's post-RoPE keys over a fixed text
(``CALIBRATION_TEXT``, its first ``CALIBRATION_TOKENS`` tokens, the first
position left out: a BOS or first token's key is often an outlier), run
once through the model itself with an f32 cache, whose rows are the keys
exactly, rounded to float16 values. The keys of the earlier layers'
outputs are then the model's own, not those of a cache that was quantized
without an offset. The result is kept in the cache directory, keyed by the
model file's fingerprint, its config, the calibration tokens and
``VERSION``, so a warm load reads 2 KB instead (the f32 program's
compile is also cached). ``LMC_KEY_OFFSETS=0`` stores keys as they are
(for comparisons).
"""
from __future__ import annotations

import io
import json
import os
import sys
import time
from typing import Any, Callable

import numpy as np

from frontends.cache_dir import cache_root, write_entry
from ir.digest import sha256
from ir.switches import switch
from ir.types import KEY_OFFSET_KV_TYPES, kv_cache_type

#: bump when the calibration changes (text, positions, rounding)
VERSION = 1
#: positions of the calibration run (its f32 cache's length)
CALIBRATION_TOKENS = 512

CALIBRATION_TEXT = '''\
The river rose in the night, and by morning the lower road was under water. People from the
village carried what they could up the hill to the old school, where the teacher had lit a fire
and set out bread, cheese and a pot of soup. Nobody spoke much at first. Then a boy asked whether
the bridge would still be there tomorrow, and his grandmother laughed and said that bridge had
seen worse floods than this one, in the year the mill burned down.

Q: What is the difference between a list and a tuple in Python?
A: A list is mutable: you can append, remove and change its items. A tuple is immutable, so it
can be used as a dictionary key or stored in a set, and it is slightly cheaper to create.

def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out


class Account:
    def __init__(self, owner: str, balance: float = 0.0) -> None:
        self.owner = owner
        self.balance = balance

    def deposit(self, amount: float) -> None:
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balance += amount

Photosynthesis converts light energy into chemical energy. In the chloroplasts, water is split,
oxygen is released, and the energy captured is used to build sugars from carbon dioxide. The
process depends on temperature, light intensity and the concentration of carbon dioxide in the air.

SELECT name, COUNT(*) AS orders FROM customers JOIN orders ON orders.customer_id = customers.id
WHERE orders.created_at >= '2024-01-01' GROUP BY name ORDER BY orders DESC LIMIT 10;

Dear Maria, thank you for your letter. The conference will take place on the 14th and 15th of
May; I have booked two rooms at the hotel near the station. Please send me the slides by Friday
so that I can print them. Best regards, Thomas.

1. Preheat the oven to 200 degrees. 2. Mix the flour, salt and butter until the mixture looks
like breadcrumbs. 3. Add the cold water a spoonful at a time. 4. Rest the dough for thirty
minutes, then roll it out and bake for twenty minutes until golden.

for (int i = 0; i < n; ++i) {
    sum += values[i] * weights[i];
}
printf("%d items, total %.2f\\n", n, sum);

The committee met on Tuesday to discuss the budget for next year. Most members agreed that the
library needs a new roof before anything else, but there was a long debate about the playground,
and in the end the decision was postponed until the spring meeting.
'''


def wants_offsets(kv_type: str | None) -> bool:
    """Whether a cache of ``kv_type`` stores keys minus an offset."""
    return kv_type in KEY_OFFSET_KV_TYPES


def calibration_ids(loaded: Any) -> list[int]:
    """The calibration run's token ids (at most ``CALIBRATION_TOKENS``)."""
    ids = loaded.tokenizer.encode(CALIBRATION_TEXT, bos=True)
    return list(ids[: min(CALIBRATION_TOKENS, loaded.config.seq_len)])


def _path(loaded: Any, ids: list[int]) -> str:
    from compiler.artifact import file_fingerprint

    what = {"version": VERSION, "file": file_fingerprint(loaded.path), "config": repr(loaded.config),
            "ids": sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()}
    key = sha256(json.dumps(what, sort_keys=True, default=repr).encode()).hexdigest()[:32]
    return os.path.join(cache_root(), "key-offsets", f"{key}.npy")


def _read(path: str, shape: tuple[int, int]) -> np.ndarray | None:
    try:
        a = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    return a if a.shape == shape and a.dtype == np.float32 and np.isfinite(a).all() else None


def mean_keys(keys: list[np.ndarray]) -> np.ndarray:
    """Per layer, the mean of its key rows [n, kv_dim] past the first,
    rounded to float16 values: float32 [n_layers, kv_dim]."""
    m = np.stack([np.asarray(k, np.float64)[1:].mean(axis=0) for k in keys])
    return m.astype(np.float16).astype(np.float32)


def calibrate(loaded: Any, f32_executor: Callable[[int], Any]) -> np.ndarray:
    """Run the calibration text through ``loaded`` with an f32 cache (the
    executor ``f32_executor(positions)`` builds: the loader's, passed in so
    that this module does not import it) and average each layer's keys
    (``mean_keys``)."""
    ids = calibration_ids(loaded)
    cfg = loaded.config
    ex = f32_executor(len(ids))
    try:
        ex.prefill(ids, 0)
        keys = []
        for i in range(cfg.n_layers):
            name = f"k_cache.{i}"
            if isinstance(ex.state, dict):     # the interpreter: arrays by name
                rows = np.asarray(ex.state[name], np.float32)
            else:                              # native: one buffer, each state at its offset
                off = int(ex.manifest["state_offsets"][name])
                rows = np.ndarray((len(ids), cfg.kv_dim), np.float32, buffer=ex.state, offset=off)
            keys.append(rows[: len(ids)].copy())
            del rows
    finally:   # its worker threads, arena and cache now, not whenever a collection finds them
        close = getattr(ex, "close", None)
        if close is not None:
            close()
    return mean_keys(keys)


def attach(loaded: Any, kv_type: str | None, status: Callable[[str], None] | None,
           f32_executor: Callable[[int], Any]) -> dict:
    """Give ``loaded`` its key offsets when ``kv_type`` stores keys against
    them: from the cache directory, else calibrated now and kept there.
    Returns what happened, for ``compile_info`` (empty when nothing was
    needed)."""
    if not wants_offsets(kv_type) or loaded.config.n_layers == 0 or not switch("LMC_KEY_OFFSETS"):
        return {}
    try:   # a type the model cannot hold is refused by the graph builder: no calibration for it first
        kv_cache_type(kv_type, 1, loaded.config.kv_dim, loaded.config.head_dim)
    except ValueError:
        return {}
    if getattr(loaded, "key_offsets", None) is not None:
        return {"key_offsets": "loaded"}
    ids = calibration_ids(loaded)
    if len(ids) < 2:
        return {}
    shape = (loaded.config.n_layers, loaded.config.kv_dim)
    path = _path(loaded, ids)
    offsets = _read(path, shape)
    if offsets is not None:
        loaded.key_offsets = offsets
        return {"key_offsets": "cached"}
    t0 = time.perf_counter()
    if status is not None:
        status(f"calibrating the key offsets of a {kv_type} cache ({len(ids)} tokens, once)")
    offsets = calibrate(loaded, f32_executor)
    secs = time.perf_counter() - t0
    buf = io.BytesIO()
    np.save(buf, offsets, allow_pickle=False)
    write_entry(path, buf.getvalue())
    loaded.key_offsets = offsets
    if status is None:
        print(f"lmc: calibrated the key offsets of a {kv_type} cache in {secs:.1f} s (kept for next time)",
              file=sys.stderr)
    return {"key_offsets": "calibrated", "key_offsets_s": round(secs, 3)}
