"""Executors run a model's token-step graphs against one KV cache.

The interpreter executor is the reference; native executors share this
interface so the generation loop does not care which one runs.
"""
from __future__ import annotations

import numpy as np

from frontends.qsf_codecs import read_region
from ir.graph import Graph
from ir.interp import WeightStore, new_state, run


class InterpExecutor:
    """Runs graphs with ``ir.interp`` (numpy references, one op at a time)."""

    name = "interp"

    def __init__(self, graphs: dict[str, Graph]) -> None:
        self.graphs = graphs
        self.weights = WeightStore(unpack=read_region)
        self.state = new_state(graphs["decode"])

    def reset(self) -> None:
        for buf in self.state.values():
            buf.fill(0)

    def prefill(self, ids: list[int], pos: int, all_logits: bool = False) -> np.ndarray:
        g = self.graphs["prefill_all" if all_logits else "prefill"]
        out = run(g, {"tokens": np.asarray(ids, np.int32), "pos": np.int32(pos)}, self.state, self.weights)
        return out["logits"]

    def decode(self, token: int, pos: int) -> np.ndarray:
        out = run(self.graphs["decode"], {"token": np.int32(token), "pos": np.int32(pos)}, self.state,
                  self.weights)
        return out["logits"]
