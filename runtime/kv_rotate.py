"""Context shift by rotation (llama.cpp's way), for one stream's contiguous
f32/f16 KV cache.

RoPE turns a key at position p by p times its frequencies, so a key moved
from p to p - n is one more turn by -n: the kept rows past ``keep`` are
moved down by n and their keys turned, with no prefill at all. It is not
what a fresh run on the kept tokens computes: above the first layer a kept
row still carries what its token attended to, dropped tokens included
(llama.cpp accepts that). The recompute (``Model._shift``) is exact; this
is the cheap alternative, measured against it in tests/test_context_shift.py.

Only where it is plainly right: the native executor, a contiguous cache of
``ctx`` rows per layer in f32 or f16, RoPE without frequency factors or a
magnitude scale (YaRN's); else ``KVRotator.of`` says why not and the
caller recomputes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from compiler.driver import CompileOptions, model_graph
from ir.ops.rope import rope_ref
from ir.rope_tables import rope_tables_at

_DTYPES = {"f32": np.float32, "f16": np.float16}


@dataclass
class CacheRows:
    """One state of the cache: where it lives and, for keys, their RoPE."""

    name: str
    offset: int
    dtype: Any
    width: int
    rope: dict[str, Any] | None     # the rope node's attributes (keys); None: values, moved as they are


class KVRotator:
    def __init__(self, executor: Any, rows: list[CacheRows], ctx: int) -> None:
        self.executor = executor
        self.rows = rows
        self.ctx = ctx

    @classmethod
    def of(cls, model: Any) -> KVRotator | str:
        """The rotator of ``model``'s cache, or why it cannot have one."""
        ex = model.executor
        if getattr(ex, "name", "") != "llvm" or not hasattr(ex, "state"):
            return "rotation needs the native executor's cache"
        if model.kv_type not in _DTYPES:
            return f"rotation needs an f32 or f16 cache, not {model.kv_type}"
        g = model_graph(model.loaded, "decode", CompileOptions(ctx=model.ctx, kv_type=model.kv_type),
                        run_passes=False)
        offsets = ex.manifest["state_offsets"]
        writes = {n.inputs[0].name: n for n in g.nodes if n.op == "kv_write"}
        rows: list[CacheRows] = []
        for name, v in g.states.items():
            t = v.type
            if t.rank != 2 or int(t.shape[0]) != model.ctx or t.dtype not in _DTYPES or name not in offsets:
                return f"rotation needs contiguous caches of {model.ctx} rows ({name}: {t})"
            w = writes.get(name)
            if w is None:
                return f"rotation: no kv_write of {name}"
            src = w.inputs[1].producer
            rope = None
            if src is not None and src.op == "rope":
                if len(src.inputs) > 2:
                    return "rotation: RoPE with frequency factors is not supported"
                rope = dict(src.attrs)
                rot = int(rope.get("dims") or rope["head_dim"])
                scaling = {k: x for k, x in rope.items() if k not in ("head_dim", "theta", "style", "dims")}
                cos0, _ = rope_tables_at(np.zeros(1, np.int64), rot, rope["theta"], attrs=scaling)
                if not np.allclose(cos0, 1.0):
                    return "rotation: RoPE with a magnitude scale (YaRN) is not supported"
            rows.append(CacheRows(name, int(offsets[name]), _DTYPES[t.dtype], int(t.shape[1]), rope))
        if not any(r.rope for r in rows):
            return "rotation: no RoPE keys in this model"
        return cls(ex, rows, model.ctx)

    def shift(self, keep: int, n: int, length: int) -> None:
        """Rows ``keep + n .. length - 1`` move to ``keep ..``, keys turned by -n."""
        state = self.executor.state
        for r in self.rows:
            view = np.ndarray((self.ctx, r.width), r.dtype, buffer=state, offset=r.offset)
            moved = view[keep + n: length].astype(np.float32)
            if r.rope is not None and len(moved):
                moved = rope_ref(moved, np.full(len(moved), -n, np.int64), **r.rope)
            view[keep: length - n] = moved.astype(r.dtype)
