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

from .pipeline import default_pipeline, run_pipeline

__all__ = ["CompileOptions", "LoadedModel", "ModelError", "build_graphs", "load_model", "model_graph"]


@dataclass
class CompileOptions:
    backend: str = "interp"
    ctx: int | None = None            # KV cache length; default: the model's context
    passes: tuple[str, ...] | None = None   # default: default_pipeline(backend)
    dump_dir: str | None = None
    dump_after: str | None = None     # with dump_dir: one pass's input and output only, or "all"
    kv_type: str = "f32"              # KV cache storage: f32, f16 or q8 (ir.types.KV_TYPES)
    split_rows: dict[str, int] | None = None  # weights streamed in row blocks (memory plan)


def model_graph(model: LoadedModel, mode: str, options: CompileOptions | None = None,
                all_logits: bool = False, stop_after: str | None = None, run_passes: bool = True) -> Graph:
    """One graph of ``model`` (decode or prefill), after the pass pipeline."""
    options = options or CompileOptions()
    g = build_graph(model.config, model.weights, mode, ctx=options.ctx, all_logits=all_logits, name=model.name,
                    kv_type=options.kv_type)
    if not run_passes:
        return g
    # prefill and prefill_all share a graph name; their dumps must not
    dump = os.path.join(options.dump_dir, g.name + ("_all" if all_logits else "")) if options.dump_dir else None
    names = options.passes if options.passes is not None else default_pipeline(options.backend)
    if options.split_rows:
        g.meta["split_rows"] = dict(options.split_rows)
        names = tuple(names) + ("split_rows",)
    return run_pipeline(g, names, dump_dir=dump, stop_after=stop_after, dump_after=options.dump_after)


def build_graphs(model: LoadedModel, options: CompileOptions | None = None) -> dict[str, Graph]:
    """The graphs a runtime needs: a decode step, a prefill chunk (last-row
    logits) and a prefill that returns every row (for ``logits``/perplexity)."""
    return {
        "decode": model_graph(model, "decode", options),
        "prefill": model_graph(model, "prefill", options),
        "prefill_all": model_graph(model, "prefill", options, all_logits=True),
    }


def load_tokenizer_file(path: str | os.PathLike, vocab_size: int | None = None):
    """A tokenizer on its own (llama2.c tokenizer.bin, GGUF or QSF file)."""
    from frontends.loader import load_tokenizer

    return load_tokenizer(path, vocab_size)
