"""The verifier: a graph is well formed, or we say exactly where it is not.

Run after every pass, so a broken rewrite is caught at the pass that broke it.
"""
from __future__ import annotations

from . import kernel_choice
from .graph import Graph
from .ops import ShapeError, get_op


class VerifyError(ValueError):
    pass


def verify(graph: Graph) -> None:
    """Check order, definitions, arity and every node's type against its rule."""
    defined: set[int] = set()
    for v in graph.inputs:
        defined.add(id(v))
    for v in graph.states.values():
        defined.add(id(v))
    for v in graph.weights.values():
        defined.add(id(v))
        if v.ref is None:
            raise VerifyError(f"weight @{v.name} has no file reference")
        if v.type.layout is None:
            raise VerifyError(f"weight @{v.name} has no layout")
        if v.ref.nbytes != v.type.nbytes():
            raise VerifyError(f"weight @{v.name}: {v.ref.nbytes} bytes stored, its type {v.type} needs "
                              f"{v.type.nbytes()}")
    names: set[str] = set()
    for i, node in enumerate(graph.nodes):
        where = f"node {i} (%{node.output.name} = {node.op})"
        try:
            op = get_op(node.op)
        except ShapeError as e:
            raise VerifyError(f"{where}: {e}") from None
        if op.n_inputs >= 0 and len(node.inputs) != op.n_inputs:
            raise VerifyError(f"{where}: takes {op.n_inputs} operands, has {len(node.inputs)}")
        for v in node.inputs:
            if id(v) not in defined:
                raise VerifyError(f"{where}: operand {v.sigil}{v.name} is not defined before use")
        try:
            t = op.infer([v.type for v in node.inputs], node.attrs)
        except (ShapeError, KeyError) as e:
            raise VerifyError(f"{where}: {e}") from None
        if t != node.output.type:
            raise VerifyError(f"{where}: type {node.output.type}, its rule gives {t}")
        try:
            kernel_choice.check(node.op, node.attrs, node.kernel)
        except ValueError as e:
            raise VerifyError(f"{where}: {e}") from None
        if node.output.name in names:
            raise VerifyError(f"{where}: name %{node.output.name} defined twice")
        if node.output.producer is not node:
            raise VerifyError(f"{where}: output does not point back to its node")
        names.add(node.output.name)
        defined.add(id(node.output))
    if not graph.outputs:
        raise VerifyError(f"graph {graph.name} has no outputs")
    for v in graph.outputs:
        if id(v) not in defined:
            raise VerifyError(f"output {v.sigil}{v.name} is not defined")
