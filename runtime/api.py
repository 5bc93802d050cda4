"""``runtime.load``: a model file or a compiled artifact, ready to run one
stream; ``runtime.load_tokenizer``: its tokenizer alone."""
from __future__ import annotations

import os
from typing import Any, Callable

from compiler.artifact import is_artifact
from compiler.driver import load_model

from .errors import RunError
from .loading import loading_text, read_artifact
from .model import Model
from .speculative import Speculation


def load(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None, backend: str = "llvm",
         ctx: int | None = None, threads: int | None = None, use_cache: bool = True,
         passes: tuple[str, ...] | None = None, mem_budget: int | None = None,
         stream: str | None = None,
         kv_type: str | None = None, stream_io: str = "pread",
         status: Callable[[str], None] | None = None,
         speculation: Speculation | None = None, context_shift: bool | str = False,
         keep: int | None = None, decode_first: bool = False) -> Model:
    """Load a model file (llama2.c .bin, GGUF, QSF) or a compiled artifact
    (``lmc compile``) and make it ready to run; native code comes from the
    compile cache when it can. ``status(text)`` hears about the slow steps
    of a cold start (``runtime.status.StatusLine`` draws them on a terminal).
    ``speculation`` (``Speculation(lookup=3)``, ``(draft="small.gguf")``,
    ``(draft_layers=6)``) makes generate/complete/chat decode speculatively:
    greedy output is plain decoding's, token for token.
    ``context_shift=True`` goes on past the context (``runtime.context_shift``):
    the first ``keep`` tokens stay (None: 0 for ``complete``, the system
    prompt's for ``chat``), the oldest half of the rest goes; ``"rotate"``
    turns the kept keys instead of recomputing them (``runtime.kv_rotate``).
    ``decode_first=True`` shortens a cold start: the model runs as soon as
    its decode step is compiled (a prompt runs as decode steps, with the
    same results) and takes the prompt chunks' code once the rest is
    compiled in the background (``lmc run`` and ``lmc chat`` do). Batched serving
    (a paged KV pool for many sequences) is ``runtime.engine.load_batch_model``."""
    if status is not None:
        status(loading_text(os.fspath(path)))
    if is_artifact(path):
        art, loaded = read_artifact(path, tokenizer, backend, kv_type)
        if ctx is not None and ctx != art.manifest["ctx"]:   # its buffers and kernels are built for its own
            raise RunError(f"{os.fspath(path)}: compiled for a context of {art.manifest['ctx']}, not {ctx} "
                           f"(recompile it with -c {ctx}, or leave -c out)")
        return Model(loaded, "llvm", ctx=art.manifest["ctx"], threads=threads, artifact=art, speculation=speculation,
                     mem_budget=mem_budget, context_shift=context_shift, keep=keep)
    return Model(load_model(path, tokenizer), backend=backend, ctx=ctx, threads=threads, use_cache=use_cache,
                 passes=passes, mem_budget=mem_budget, stream=stream, kv_type=kv_type, stream_io=stream_io,
                 status=status, speculation=speculation, context_shift=context_shift, keep=keep,
                 decode_first=decode_first)


def load_tokenizer(path: str | os.PathLike, vocab_size: int | None = None) -> Any:
    """The tokenizer alone: from a llama2.c tokenizer.bin (``vocab_size``:
    its checkpoint's), a GGUF file (a model or a vocabulary-only file) or a
    QSF model. ``encode(text, bos=True)``, ``decode(ids)``."""
    from compiler.driver import load_tokenizer_file

    return load_tokenizer_file(path, vocab_size)
