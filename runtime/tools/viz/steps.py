"""The compiler's pass pipeline run once on a model's graph, with a copy of
the graph kept after each pass: the steps ``lmc viz`` shows.

Passes rewrite the graph in place (``fuse_dequant`` turns a matmul node into
a qmatmul), so each step is a deep copy taken as the pipeline's ``on_pass``
hook sees it; the graphs hold weight references, never weight data, so a
copy of a whole model's graph is cheap.
"""
from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass
from typing import Any

from compiler.driver import CompileOptions, LoadedModel, model_graph, pass_names
from compiler.pipeline import run_pipeline
from ir.graph import Graph
from passes import PASSES

#: the name of step 0: the graph as the frontend built it
FRONTEND = "frontend"


@dataclass
class Step:
    """The graph after one pass (step 0: before any)."""

    index: int
    name: str
    doc: str
    graph: Graph
    #: time the pass took, its verification included (0 for the frontend's graph)
    seconds: float


def pass_doc(name: str) -> str:
    """A pass's one-line description: its function's, else its module's first line."""
    p = PASSES[name]
    if p.doc:
        return p.doc
    mod = sys.modules.get(p.run.__module__)
    lines = (mod.__doc__ or "").strip().splitlines() if mod else []
    return lines[0] if lines else ""


def copy_graph(g: Graph) -> Graph:
    """A deep copy of ``g``, its nodes copied in order: each one's inputs are
    then copied already, so the copy does not recurse along the whole chain
    of producers (``copy.deepcopy(g)`` alone exceeds Python's recursion
    limit on a 30-layer model)."""
    memo: dict[int, Any] = {}
    for n in g.nodes:
        copy.deepcopy(n, memo)
    return copy.deepcopy(g, memo)


def record_steps(model: LoadedModel, mode: str, options: CompileOptions,
                 split_rows: dict[str, int] | None = None) -> list[Step]:
    """The frontend's graph of ``mode`` and the graph after every pass of
    ``options``' pipeline, as ``compile`` runs it (``split_rows``: the
    memory plan's head split, then the last pass, as ``model_graph`` adds it)."""
    graph = model_graph(model, mode, options, run_passes=False)
    names = pass_names(options)
    if split_rows:
        graph.meta["split_rows"] = dict(split_rows)
        names = names + ("split_rows",)
    steps = [Step(0, FRONTEND, "the graph as the model's frontend built it", copy_graph(graph), 0.0)]
    clock = [time.perf_counter()]

    def keep(name: str, g: Graph) -> None:
        now = time.perf_counter()
        steps.append(Step(len(steps), name, pass_doc(name), copy_graph(g), now - clock[0]))
        clock[0] = time.perf_counter()   # the copy is not the next pass's time

    run_pipeline(graph, names, on_pass=keep)
    return steps
