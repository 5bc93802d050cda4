"""The pass pipeline: named phases, the graph verified after each, optional
text dumps so that any pass's effect is a diff."""
from __future__ import annotations

import os
from typing import Callable, Sequence

import passes
from ir.graph import Graph
from ir.printer import print_graph
from ir.verify import verify

#: Passes run by default, in order (``schedule`` last: it orders what the others made).
DEFAULT_PIPELINE: tuple[str, ...] = ("fuse_dequant", "fuse_elementwise", "schedule")


def default_pipeline(backend: str = "interp") -> tuple[str, ...]:
    """The passes for a backend on this host. Native code on a CPU with int8
    dot products (VNNI) also runs ``int_dot``: matmuls on 32-block weights
    and K-quants (decode and prompt rows) quantize x per block and use
    integer dot products, as llama.cpp does; and ``repack``: their weights
    are regrouped at load for one GEMM kernel of every row count (when the
    graph says the width, ``CompileOptions.repack_width``), then
    ``fuse_residual``: residual adds become those kernels' epilogues, and
    ``fuse_norm``: RMSNorms move into those kernels' quantization. The
    interpreter stays on the float reference path unless given the passes."""
    if backend == "llvm":
        from .codegen.target import host_target
        if host_target().int_dot:
            return DEFAULT_PIPELINE[:-1] + ("int_dot", "repack", "fuse_residual", "fuse_norm") + DEFAULT_PIPELINE[-1:]
    return DEFAULT_PIPELINE


def run_pipeline(graph: Graph, names: Sequence[str] = DEFAULT_PIPELINE, dump_dir: str | None = None,
                 stop_after: str | None = None,
                 on_pass: Callable[[str, Graph], None] | None = None,
                 dump_after: str | None = None) -> Graph:
    """Run the named passes in order; verify after each. With ``dump_dir``,
    write the text IR before the first pass and after each one, or, with
    ``dump_after`` naming a pass, only that pass's input and output (the two
    files to diff); ``dump_after="all"`` is every stage."""
    names = tuple(names)
    if dump_after not in (None, "all") and dump_after not in names:
        raise ValueError(f"--dump-after {dump_after}: not a pass of this pipeline "
                         f"({', '.join(names) or 'no passes'}, or all)")
    stages = dump_stages(names, dump_after)
    verify(graph)
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        _clear_dumps(dump_dir)
        if 0 in stages:
            _dump(dump_dir, 0, "input", graph)
    for i, name in enumerate(names, 1):
        if name not in passes.PASSES:
            raise ValueError(f"unknown pass {name!r} (known: {', '.join(sorted(passes.PASSES))})")
        graph = passes.PASSES[name].run(graph)
        verify(graph)
        if dump_dir and i in stages:
            _dump(dump_dir, i, name, graph)
        if on_pass:
            on_pass(name, graph)
        if name == stop_after:
            break
    return graph


def dump_stages(names: Sequence[str], dump_after: str | None) -> set[int]:
    """Stages to write (0 = the input, i = after the i-th pass): all of them,
    or the named pass's output and the stage before it."""
    if dump_after in (None, "all"):
        return set(range(len(names) + 1))
    i = list(names).index(dump_after) + 1
    return {i - 1, i}


def _clear_dumps(folder: str) -> None:
    """Drop an earlier run's stage files, so the folder shows this run only."""
    for f in os.listdir(folder):
        if len(f) > 3 and f[:2].isdigit() and f[2] == "-" and f.endswith(".txt"):
            os.remove(os.path.join(folder, f))


def _dump(folder: str, i: int, name: str, graph: Graph) -> None:
    with open(os.path.join(folder, f"{i:02d}-{name}.txt"), "w") as f:
        f.write(print_graph(graph))
