"""Executors run a model's token-step graphs against one KV cache.

The interpreter executor is the reference; native executors share this
interface so the generation loop does not care which one runs. Graphs
built for batched serving (``batch``, ``batch_last``, ``batch_decode``: a
paged KV pool) run through ``batch`` instead of ``decode``/``prefill``
(``runtime.paged``).
"""
from __future__ import annotations

import numpy as np

from frontends.qsf_codecs import read_region
from ir.graph import Graph
from ir.interp import WeightStore, new_state, run
from ir.ops.attention import sliding_window

from .paged import PagedBatch, PoolShape, single_stream_only
from .ring_reach import RingReach


class InterpExecutor(PagedBatch, RingReach):
    """Runs graphs with ``ir.interp`` (numpy references, one op at a time).
    ``max_rows``: rows a batch step may take (as a native plan's T), None
    for any number."""

    name = "interp"

    def __init__(self, graphs: dict[str, Graph], max_rows: int | None = None) -> None:
        self.graphs = graphs
        self.weights = WeightStore(unpack=read_region)
        first = next(iter(graphs.values()))
        self.state = new_state(first)
        self.ctx = int(first.meta.get("ctx", 0))
        self.ring_slack = first.meta.get("ring_slack")
        if "batch" in graphs:
            m = first.meta
            vocab = int(graphs["batch"].outputs[0].type.shape[-1])
            self.pool = PoolShape(int(m["block_size"]), int(m["n_blocks"]), int(m["max_blocks"]), self.ctx, vocab,
                                  max_rows, m.get("max_batch"), sliding_window(graphs["batch"]))

    def reset(self) -> None:
        for buf in self.state.values():
            buf.fill(0)
        self.forget_writes()

    def prefill(self, ids: list[int], pos: int, all_logits: bool = False) -> np.ndarray:
        if "prefill" not in self.graphs:
            raise single_stream_only("prefill")
        g = self.graphs["prefill_all" if all_logits else "prefill"]
        self.wrote(pos + len(ids))
        step = self.ring_slack or len(ids)   # a ring takes at most its slack of rows a step
        outs = [run(g, {"tokens": np.asarray(ids[i: i + step], np.int32), "pos": np.int32(pos + i)}, self.state,
                    self.weights)["logits"] for i in range(0, len(ids), step)]
        return np.concatenate(outs) if all_logits else outs[-1]

    def verify(self, ids: list[int], pos: int) -> np.ndarray:
        """As ``NativeExecutor.verify``: every row as decode computes it."""
        if "verify" not in self.graphs:
            return np.stack([np.array(self.decode(t, pos + i)) for i, t in enumerate(ids)])
        self.wrote(pos + len(ids))
        out = run(self.graphs["verify"], {"tokens": np.asarray(ids, np.int32), "pos": np.int32(pos)}, self.state,
                  self.weights)
        return out["logits"]

    def decode(self, token: int, pos: int) -> np.ndarray:
        if "decode" not in self.graphs:
            raise single_stream_only("decode")
        self.wrote(pos + 1)
        out = run(self.graphs["decode"], {"token": np.int32(token), "pos": np.int32(pos)}, self.state,
                  self.weights)
        return out["logits"]

    def _entry_names(self):
        return self.graphs

    def _batch_step(self, tokens: np.ndarray, positions: np.ndarray, tables: np.ndarray,
                    last_only: bool, decode: bool = False, rows: np.ndarray | None = None) -> np.ndarray:
        name = "batch_last" if last_only else "batch_decode" if decode and "batch_decode" in self.graphs else \
            "batch_sel" if rows is not None else "batch"
        feeds = {"tokens": tokens, "positions": positions, "block_tables": tables}
        if rows is not None:
            feeds["rows"] = rows
        out = run(self.graphs[name], feeds, self.state, self.weights)
        return out["logits"]

    def _copy_block_rows(self, src: int, dst: int) -> None:
        bs = self.pool.block_size
        for buf in self.state.values():
            buf[dst * bs: (dst + 1) * bs] = buf[src * bs: (src + 1) * bs]
