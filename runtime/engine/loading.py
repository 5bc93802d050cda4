"""The batch engine's model: a model file (or an artifact compiled for
batched serving) built with the paged batch steps over a pool of KV blocks
(``runtime.paged``), which the engine drives through ``executor.batch``.

It is not a ``runtime.Model``: it has no single-stream methods, only what
the engine, the server and a drafter built beside it need.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from compiler.artifact import is_artifact
from compiler.driver import BatchOptions, LoadedModel, load_model
from frontends.arch import ModelConfig

from ..errors import RunError
from ..loading import BuildOptions, build_executor, check_run_options, loading_text, read_artifact


@dataclass
class BatchModel:
    """A model built for batched serving (``DraftTarget`` for a drafter)."""

    loaded: LoadedModel
    executor: Any
    ctx: int
    kv_type: str
    kv_bytes: int
    #: the KV pool's options, ``n_blocks`` resolved
    batch: BatchOptions
    build: BuildOptions
    compile_info: dict = field(default_factory=dict)

    @property
    def config(self) -> ModelConfig:
        return self.loaded.config

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def backend(self) -> str:
        return self.build.backend


def load_batch_model(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None, *,
                     batch: BatchOptions, backend: str = "llvm", ctx: int | None = None,
                     threads: int | None = None, use_cache: bool = True, passes: tuple[str, ...] | None = None,
                     kv_type: str | None = None, status: Callable[[str], None] | None = None) -> BatchModel:
    """Load a model file for batched serving: a paged KV pool of
    ``batch`` (``BatchOptions(block_size, n_blocks, max_batch)``; n_blocks
    None: ``max_batch`` sequences of the whole context), driven through
    ``model.executor.batch(tokens, positions, tables)``. An artifact must
    have been compiled for batched serving."""
    if status is not None:
        status(loading_text(os.fspath(path)))
    art = None
    if is_artifact(path):
        art, loaded = read_artifact(path, tokenizer, backend, kv_type)
        if not art.manifest.get("batch"):
            raise RunError(f"{path}: not compiled for batched serving")
        ctx = art.manifest["ctx"]
    else:
        loaded = load_model(path, tokenizer)
    full_ctx = check_run_options(loaded, ctx, threads, kv_type)
    build = BuildOptions(backend if art is None else "llvm", threads, use_cache, passes, status)
    built = build_executor(loaded, build, full_ctx, artifact=art, kv_type=kv_type, batch=batch)
    return BatchModel(loaded, built.executor, built.ctx, built.kv_type, built.kv_bytes, built.batch, build,
                      built.compile_info)
