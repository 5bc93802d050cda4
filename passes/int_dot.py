"""int_dot: decode-step ``qmatmul`` on 32-value block weights takes the
integer path (``act="q8"``).

A decode step is one matrix-vector product per weight: bandwidth-bound, and
on x86 with VNNI an int8 dot product reads the weight bytes with fewer
instructions than decoding them to floats. So, as llama.cpp does, the
activation row is quantized to Q8_0-style blocks and each block product is an
integer sum scaled by d_w * d_x (``ir.ops.qmatmul_ref`` defines the numbers).
Prefill graphs are left alone: their matmuls are compute-bound and the float
kernels tile them. Whether to run the pass is the pipeline's choice (it
changes results slightly: x is rounded to 8 bits per block); the compiler
can ask ``compiler.codegen.k_matmul_int.host_has_int_dot()``.
"""
from __future__ import annotations

from ir.graph import Graph
from ir.ops import INT_DOT_LAYOUTS, QK8

from .registry import register_pass


@register_pass("int_dot")
def int_dot(graph: Graph) -> Graph:
    """Quantize activations per block (q8) for decode qmatmuls on Q8_0/Q4_0/Q5_0 weights."""
    if graph.meta.get("mode") != "decode":
        return graph
    for node in graph.nodes:
        if node.op != "qmatmul" or node.attrs.get("layout") not in INT_DOT_LAYOUTS:
            continue
        k = node.inputs[1].type.shape[1]
        if not isinstance(k, int) or k % QK8:
            continue
        node.attrs = {**node.attrs, "act": "q8"}
    return graph
