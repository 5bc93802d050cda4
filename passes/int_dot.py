"""int_dot: decode-step ``qmatmul`` on 32-value block weights (Q8_0, Q4_0,
Q5_0, Q4_1, Q5_1) takes the integer path (``act="q8"``), and on the
K-quants Q2_K .. Q6_K the same with 256-value activation blocks and
per-16 partial sums (``act="q8k"``, llama.cpp's Q8_K: ``ir.int_dot``).
QSF's 64-value blocks (QSF_Q8, QSF_Q4, QSF_Q2, QSF_Q2S, QSF_TERNARY) take
``act="q8"`` too, each block two activation blocks sharing its scale and
offset (``ir.int_dot``; kernels ``matmul/int_qsf``, ternary without
multiplies), in decode, batches of decode rows and prompt chunks alike.

A decode step is one matrix-vector product per weight: bandwidth-bound, and
on x86 with VNNI an int8 dot product reads the weight bytes with fewer
instructions than decoding them to floats. So, as llama.cpp does, the
activation row is quantized to Q8_0-style blocks and each block product is an
integer sum scaled by d_w * d_x (``ir.ops.qmatmul_ref`` defines the numbers).
Prompt chunks (``prefill``, ``batch``) take the same path as an int8 GEMM
(the ``gemm`` attribute: ``GEMM_ROWS`` token rows quantized at once, each
weight tile unpacked once for all of them, ``matmul/gemm``): there
the int8 products beat the float tiles, and each row's numbers depend on
the row alone, however the prompt is chunked, though not the decode step's
bits (graphs that need those, ``verify`` and ``batch_decode``, never carry
the attribute: ``compiler.driver._rows_as_decode`` turns it into
``decode_rows``); llama.cpp, too, quantizes the activations of every
matmul on these types. Other matmuls
keep the float kernels' prefill tiles. Whether to run the pass is the pipeline's choice (it
changes results slightly: x is rounded to 8 bits per block); the compiler
can ask ``compiler.codegen.target.host_target().int_dot``.

A batch graph of decode rows (``meta["decode_rows"]``: ``batch_decode``,
each row a sequence's next token, at most ``meta["max_batch"]``) must give
every row the decode step's numbers, bit for bit, or a served sequence
drifts from ``lmc run``'s. So its matmuls get ``decode_rows`` = max_batch:
kernels compute each row with the one-row (decode) arithmetic, reading each
weight tile once for all rows; and those on 32-block weights take the
integer path as in decode.
"""
from __future__ import annotations

from ir.graph import Graph
from ir.quant import get_layout
from ir.int_dot import int_act
from ir.quant import ACT_BLOCK

from .registry import register_pass


#: rows of a prompt chunk quantized at once where the prompt runs with
#: decode's arithmetic (``verify``): each weight block is unpacked
#: once for all of them (``lmc kernel qmatmul --batch 64``, Q5_0 4864x896,
#: 2 threads: 2.3 ms against the float tiles' 3.7)
PROMPT_ROWS = 8
#: token rows of a prompt chunk quantized at once for the integer GEMM
#: (``matmul/gemm``, the ``gemm`` attribute): each weight tile is
#: unpacked once per this many tokens (the default prefill chunk: once)
GEMM_ROWS = 128


def _row_block(layout: str, act: str) -> int:
    """What the row length must be a multiple of: the activation block and
    the weight's (QSF: 64 values, two activation blocks)."""
    return max(ACT_BLOCK[act], getattr(get_layout(layout), "block", 1))


@register_pass("int_dot")
def int_dot(graph: Graph) -> Graph:
    """Quantize activations per block for qmatmuls on 32-value block weights
    (``act="q8"``: Q8_0, Q4_0, Q5_0, Q4_1, Q5_1; QSF's 64-value blocks) and on K-quants
    (``act="q8k"``: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K); in a graph of decode rows, also
    compute every row as decode does."""
    mode = graph.meta.get("mode")
    if mode not in ("prefill", "batch", "decode"):
        return graph
    decode_rows = mode == "batch" and bool(graph.meta.get("decode_rows"))
    if decode_rows:
        for node in graph.nodes:
            if node.op in ("matmul", "qmatmul"):
                node.kernel = {**node.kernel, "decode_rows": int(graph.meta["max_batch"])}
    prompt = mode != "decode" and not decode_rows
    for node in graph.nodes:
        act = int_act(node.attrs.get("layout")) if node.op == "qmatmul" else None
        if act is None:
            continue
        k = node.inputs[1].type.shape[1]
        if not isinstance(k, int) or k % _row_block(node.attrs["layout"], act):
            continue
        node.attrs = {**node.attrs, "act": act}
        if prompt:
            node.kernel = {**node.kernel, "gemm": GEMM_ROWS}
    return graph
