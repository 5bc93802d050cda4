"""The compiler driver: model file -> loaded model -> planned graphs.

The interpreter backend runs these graphs directly; the native backend
(next step) lowers the same graphs to machine code.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from frontends.arch import ModelError, build_graph
from frontends.loader import LoadedModel, load_model
from ir.graph import Graph
from ir.printer import print_graph
from ir.switches import switch
from ir.types import DEFAULT_KV_TYPE

from .pipeline import default_pipeline, run_pipeline

__all__ = ["BatchOptions", "CompileOptions", "LoadedModel", "ModelError", "build_graphs", "load_model",
           "model_graph", "repack_width"]


@dataclass(frozen=True)
class BatchOptions:
    """Continuous batching: the KV cache becomes a pool of ``n_blocks``
    blocks of ``block_size`` positions, each sequence addressing its own
    through a block table, and one step advances up to ``max_batch``
    sequences (or a prompt chunk of one). ``n_blocks`` None: enough for
    ``max_batch`` sequences of the whole context."""

    block_size: int = 16
    n_blocks: int | None = None
    max_batch: int = 8

    def resolved(self, ctx: int) -> "BatchOptions":
        """With ``n_blocks`` filled in for a context of ``ctx``; checks the values."""
        for what, v in (("block_size", self.block_size), ("max_batch", self.max_batch),
                        ("n_blocks", 1 if self.n_blocks is None else self.n_blocks)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"batch {what} must be a positive integer, got {v!r}")
        nb = self.n_blocks if self.n_blocks is not None else self.max_batch * max_blocks_per_seq(ctx, self.block_size)
        return BatchOptions(self.block_size, nb, self.max_batch)


def max_blocks_per_seq(ctx: int, block_size: int) -> int:
    """Block table length: blocks a sequence of the whole context needs."""
    return -(-ctx // block_size)


@dataclass
class CompileOptions:
    backend: str = "interp"
    ctx: int | None = None            # KV cache length; default: the model's context
    passes: tuple[str, ...] | None = None   # default: default_pipeline(backend)
    dump_dir: str | None = None
    dump_after: str | None = None     # with dump_dir: one pass's input and output only, or "all"
    kv_type: str = DEFAULT_KV_TYPE    # KV cache storage: f16, f32, q8, q4, q2 ... (ir.types.KV_TYPES)
    split_rows: dict[str, int] | None = None  # weights streamed in row blocks (memory plan)
    batch: BatchOptions | None = None  # build the paged batch graphs instead of decode/prefill
    verify: bool = False               # also the ``verify`` graph (speculative decoding)
    #: tile width of repacked weights (``passes/repack``; ``repack_width()``), None: none repacked
    repack_width: int | None = None
    #: the most rows a decode/prefill step takes (the native prompt chunk): sliding-window
    #: layers then keep a ring of window + max_rows positions (``build_graph``); None: whole caches
    max_rows: int | None = None
    #: prompt rows from position ``FROM_POSITION`` on attend on AMX bf16 tiles
    #: where the host has them (``k_attention_tiled``: such a row differs in its last bits from the
    #: same token's decode step); not the verify graph, whose rows must have the decode step's bits
    attn_tiled: bool = False


def repack_width(vector_width: int | None = None) -> int | None:
    """The width the ``repack`` pass tiles weights to on this host at this
    vector width (16 with AVX-512 VNNI, 8 with 256-bit VNNI), None without
    VNNI or with ``LMC_REPACK=0`` (weights as the file stores them: for
    comparisons)."""
    if not switch("LMC_REPACK"):
        return None
    from .codegen.target import host_target, vnni_width

    return vnni_width(vector_width or host_target().vector_width)


#: a model's prompt rows from this position on take the tiles. One call of 128 rows ending there,
#: Qwen2.5's shape, 1 thread (lmc kernel attention --batch 128 --hot, Emerald Rapids): per row /
#: tiled 974 / 872 us at 256 positions, 2,239 / 1,356 at 512, 6,997 / 2,578 at 1,024, 13,558 /
#: 5,025 at 2,048. Short prompts, where attention costs little, keep the decode step's bits
FROM_POSITION = 512


def attention_tiles() -> bool:
    """``LMC_ATTN_TILED`` (on unless 0): a prompt's rows from position
    ``FROM_POSITION`` on attend on AMX bf16 tiles where the host has them and
    the cache is f16 (``codegen/k_attention_tiled``), as llama.cpp's flash attention: a long
    prompt's attention several times faster. Such a row no longer has the bits of the same
    token's decode step (outputs to ~1e-6); a row before that position keeps them, and a row's
    bits depend on its position, not on how its prompt was cut into chunks."""
    return switch("LMC_ATTN_TILED")


def pass_names(options: CompileOptions) -> tuple[str, ...]:
    """The pipeline ``options`` asks for: its own list or the backend's default."""
    return tuple(options.passes if options.passes is not None else default_pipeline(options.backend))


def model_graph(model: LoadedModel, mode: str, options: CompileOptions | None = None,
                all_logits: bool = False, stop_after: str | None = None, run_passes: bool = True,
                decode_rows: bool = False, select: bool = False) -> Graph:
    """One graph of ``model`` (decode, prefill or batch), after the pass pipeline.
    ``decode_rows``: a batch graph whose every row is a sequence's next token
    (``batch_decode``), which passes may treat as decode steps (``int_dot``);
    a prefill graph (with ``all_logits``) whose every row is computed as the
    decode step computes it (``verify``, see ``verify_graph``). ``select``:
    a batch graph returning the logits of the rows an input names, as many
    as ``max_batch`` (``batch_sel``)."""
    options = options or CompileOptions()
    paged = {}
    if mode == "batch":
        if options.batch is None:
            raise ValueError("a batch graph needs CompileOptions.batch")
        bo = options.batch.resolved(options.ctx or model.config.seq_len)
        paged = dict(block_size=bo.block_size, n_blocks=bo.n_blocks)
    if select:
        paged["select"] = bo.max_batch
    rows = {"max_rows": options.max_rows} if mode != "batch" and options.max_rows else {}
    g = build_graph(model.config, model.weights, mode, ctx=options.ctx, all_logits=all_logits, name=model.name,
                    kv_type=options.kv_type, key_offsets=getattr(model, "key_offsets", None), **paged, **rows)
    if options.attn_tiled and mode == "prefill" and not decode_rows:
        for node in g.nodes:
            if node.op == "attention":
                node.attrs.update(tiled=1, tiled_from=FROM_POSITION)
    if mode == "batch":
        g.meta.update(max_batch=bo.max_batch, decode_rows=decode_rows)
    if options.repack_width:
        g.meta["repack_width"] = options.repack_width
    if not run_passes:
        return g
    # prefill and prefill_all (the batch graphs too) share a graph name; their dumps must not
    if mode == "batch":
        suffix = "_decode" if decode_rows else "_sel" if select else "" if all_logits else "_last"
    else:
        suffix = "_verify" if decode_rows else "_all" if all_logits else ""
    dump = os.path.join(options.dump_dir, g.name + suffix) if options.dump_dir else None
    names = pass_names(options)
    if options.split_rows:
        g.meta["split_rows"] = dict(options.split_rows)
        names = tuple(names) + ("split_rows",)
    g = run_pipeline(g, names, dump_dir=dump, stop_after=stop_after, dump_after=options.dump_after)
    if mode == "prefill" and decode_rows:
        _rows_as_decode(g)
    return g


#: ``decode_rows`` of the float matmuls in a ``verify`` graph: a flag there
#: (their kernels then tile tokens as decode rows), never a limit on T
VERIFY_ROWS = 16


def _rows_as_decode(g: Graph) -> None:
    """Every matmul of a prefill graph computes each row with the decode
    step's arithmetic (``matmul/float_tiles``: decode's accumulators and order, each
    weight vector still shared by a tile of rows). The float prefill tiles
    and the integer GEMM of prompt chunks (``int_dot``'s ``gemm``) sum in
    another order, so their last bits differ from decode's and a greedy
    verify could part from plain decoding at a near tie: the GEMM's
    matmuls go back to the integer path's decode arithmetic,
    ``PROMPT_ROWS`` rows sharing each unpacked block. Attention, norms and
    elementwise kernels compute a row alike in both modes."""
    from passes.int_dot import PROMPT_ROWS

    g.meta["decode_rows"] = True
    for node in g.nodes:
        if node.op not in ("matmul", "qmatmul", "qmatmul_rows") or "decode_rows" in node.kernel:
            continue
        if node.inputs[1].type.repack:   # one arithmetic for every row count already
            continue
        node.kernel = {"decode_rows": PROMPT_ROWS if "gemm" in node.kernel else VERIFY_ROWS}


def build_graphs(model: LoadedModel, options: CompileOptions | None = None,
                 only: tuple[str, ...] | None = None) -> dict[str, Graph]:
    """The graphs a runtime needs: a decode step, a prefill chunk (last-row
    logits) and a prefill that returns every row (for ``logits``/perplexity).
    With ``options.batch``, the paged batch graphs instead: ``batch`` (a row
    of logits per row) and ``batch_last`` (the last row's); their KV pool
    cannot be shared with a single stream's cache. When ``int_dot`` puts
    some matmul of the decode step on the integer path, also
    ``batch_decode``: ``batch`` for rows that are each a sequence's next
    token (at most ``max_batch``), every matmul computing each row as the
    decode step does, integer path included, so a served sequence decodes
    to the single stream's numbers; prompt chunks stay on the float
    ``batch``/``batch_last``. (Where every matmul reads repacked weights,
    ``passes/repack``, each row has the decode step's numbers in ``batch``
    already, and ``batch_decode`` would be the same graph: it is left out
    and the runtime runs decode rows through ``batch``.) Without
    ``batch_decode``, also ``batch_sel``: ``batch`` returning only the
    logits of the rows an input names (up to ``max_batch``), so one step
    runs decode rows and prompt chunks together. With
    ``options.verify``, also ``verify``: a
    prefill returning every row, each row computed as the decode step
    computes it, so that speculative decoding's batched check of drafted
    tokens gives plain decoding's logits bit for bit. ``only``: a single
    stream's graphs of these names alone (a decode step to start on)."""
    if options is not None and options.batch is not None:
        graphs = {
            "batch": model_graph(model, "batch", options, all_logits=True),
            "batch_last": model_graph(model, "batch", options),
        }
        if "int_dot" in pass_names(options):
            g = model_graph(model, "batch", options, all_logits=True, decode_rows=True)
            # else it is ``batch`` again: no integer path, or every matmul on repacked weights
            if any(n.attrs.get("act") for n in g.nodes) and print_graph(g) != print_graph(graphs["batch"]):
                graphs["batch_decode"] = g
        if "batch_decode" not in graphs:   # decode rows have batch's numbers: they may share a step with prompts
            graphs["batch_sel"] = model_graph(model, "batch", options, select=True)
        return graphs
    how = {
        "decode": lambda: model_graph(model, "decode", options),
        "prefill": lambda: model_graph(model, "prefill", options),
        "prefill_all": lambda: model_graph(model, "prefill", options, all_logits=True),
    }
    if options is not None and options.verify:
        how["verify"] = lambda: model_graph(model, "prefill", options, all_logits=True, decode_rows=True)
    return {name: make() for name, make in how.items() if only is None or name in only}


def load_tokenizer_file(path: str | os.PathLike, vocab_size: int | None = None):
    """A tokenizer on its own (llama2.c tokenizer.bin, GGUF or QSF file)."""
    from frontends.loader import load_tokenizer

    return load_tokenizer(path, vocab_size)
