"""The pass pipeline: named phases, the graph verified after each, optional
text dumps so that any pass's effect is a diff."""
from __future__ import annotations

import os
from typing import Callable, Sequence

import passes
from ir.graph import Graph
from ir.printer import print_graph
from ir.verify import verify

#: Passes run by default, in order.
DEFAULT_PIPELINE: tuple[str, ...] = ("fuse_dequant",)


def default_pipeline(backend: str = "interp") -> tuple[str, ...]:
    """The passes for a backend on this host. Native code on a CPU with int8
    dot products (VNNI) also runs ``int_dot``: decode matvecs on 32-block
    weights quantize x per block and use integer dot products, as llama.cpp
    does. The interpreter stays on the float reference path."""
    if backend == "llvm":
        from .codegen.k_matmul_int import host_has_int_dot
        if host_has_int_dot():
            return DEFAULT_PIPELINE + ("int_dot",)
    return DEFAULT_PIPELINE


def run_pipeline(graph: Graph, names: Sequence[str] = DEFAULT_PIPELINE, dump_dir: str | None = None,
                 stop_after: str | None = None,
                 on_pass: Callable[[str, Graph], None] | None = None) -> Graph:
    """Run the named passes in order; verify after each."""
    verify(graph)
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        _dump(dump_dir, 0, "input", graph)
    for i, name in enumerate(names, 1):
        if name not in passes.PASSES:
            raise ValueError(f"unknown pass {name!r} (known: {', '.join(sorted(passes.PASSES))})")
        graph = passes.PASSES[name].run(graph)
        verify(graph)
        if dump_dir:
            _dump(dump_dir, i, name, graph)
        if on_pass:
            on_pass(name, graph)
        if name == stop_after:
            break
    return graph


def _dump(folder: str, i: int, name: str, graph: Graph) -> None:
    with open(os.path.join(folder, f"{i:02d}-{name}.txt"), "w") as f:
        f.write(print_graph(graph))
