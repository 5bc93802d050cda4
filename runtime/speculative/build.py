"""Building the drafter a ``Speculation`` asks for, beside a loaded target:
a single-stream ``Model`` or the batch engine's model alike.

It loads and compiles: a second model file for ``--draft`` (with its own
KV cache, or for a batch target a paged pool of its own of the target's
shape), or the target's own first K layers for ``--draft-layers``, compiled
as a graph of K layers whose KV state is laid out as the target's first K
layers' and run on the target's cache (or pool) itself.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Protocol

from compiler.driver import BatchOptions, CompileOptions, LoadedModel, build_graphs, load_model

from ..errors import RunError
from ..executor import InterpExecutor
from ..loading import BuildOptions, build_executor
from .config import Speculation, SpeculationError
from .draft_kv import PagedKV, StreamKV
from .lookup import LookupDrafter
from .model_drafter import ModelDrafter
from .protocol import Drafter


class DraftTarget(Protocol):
    """What the builder reads of the model it drafts for."""

    loaded: LoadedModel
    ctx: int
    kv_type: str
    build: BuildOptions
    executor: Any
    #: the KV pool's options when built for batched serving, else None
    batch: BatchOptions | None


def build_drafter(target: DraftTarget, spec: Speculation, draft_loaded: LoadedModel | None = None) -> Drafter:
    """The drafter of ``spec`` for ``target``. ``draft_loaded``: the draft
    file already read (``check_draft``). Raises ``RunError`` (one line) for
    a draft of another vocabulary or more layers than the target has."""
    try:
        if spec.lookup:
            return LookupDrafter(spec.lookup)
        if spec.draft is not None:
            return _draft_model(target, spec, draft_loaded)
        return _first_layers(target, spec)
    except SpeculationError as e:
        raise RunError(str(e)) from None


def check_draft(target_loaded: LoadedModel, ctx: int, spec: Speculation, batched: bool) -> LoadedModel | None:
    """What can be refused before compiling anything: a missing draft file,
    another vocabulary, K outside the target's layers, and for a batch (whose
    pools share their block tables) a draft of a shorter context. Returns
    the draft file read (``--draft``) or None; raises ``RunError``."""
    try:
        if spec.draft is None:
            check_layers(spec.draft_layers, target_loaded.config.n_layers)
            return None
        loaded = read_draft(spec)
        check_vocabulary(target_loaded.tokenizer, target_loaded.config.vocab_size, loaded)
        if batched and loaded.config.seq_len < ctx:
            raise SpeculationError(f"--draft {os.path.basename(loaded.path)}: its context is {loaded.config.seq_len} "
                                   f"positions, less than the server's {ctx} (lower -c)")
        return loaded
    except SpeculationError as e:
        raise RunError(str(e)) from None


def same_vocabulary(a: Any, b: Any) -> str | None:
    """Why tokenizers ``a`` and ``b`` differ (None when every id is the same piece)."""
    na, nb = int(a.vocab_size), int(b.vocab_size)
    if na != nb:
        return f"{nb} tokens against the target's {na}"
    piece_a, piece_b = getattr(a, "id_to_piece", None), getattr(b, "id_to_piece", None)
    if piece_a is None or piece_b is None:
        return None
    for i in range(na):
        if piece_a(i) != piece_b(i):
            return f"token {i} is {piece_b(i)!r}, the target's is {piece_a(i)!r}"
    return None


def read_draft(spec: Speculation) -> LoadedModel:
    """``spec.draft``'s model file, read (not compiled)."""
    name = os.fspath(spec.draft)
    if not os.path.exists(name):
        raise SpeculationError(f"--draft {name}: no such file")
    return load_model(name, spec.draft_tokenizer)


def check_vocabulary(target_tokenizer: Any, target_vocab: int, draft: LoadedModel) -> None:
    """Refuse a draft (a ``LoadedModel``) whose ids are not the target's."""
    why = same_vocabulary(target_tokenizer, draft.tokenizer)
    if why is None and draft.config.vocab_size != target_vocab:
        why = f"{draft.config.vocab_size} logits against the target's {target_vocab}"
    if why is not None:
        raise SpeculationError(f"--draft {os.path.basename(draft.path)}: not the target's vocabulary ({why})")


def check_layers(k: int, n_layers: int) -> None:
    if not 1 <= k < n_layers:
        raise SpeculationError(f"--draft-layers {k}: the model has {n_layers} layers (take 1 to {n_layers - 1})")


def _is_path(draft: object) -> bool:
    return isinstance(draft, (str, bytes, os.PathLike))


def _draft_model(target: DraftTarget, spec: Speculation, loaded: LoadedModel | None) -> ModelDrafter:
    """A second model with a cache of its own: for a batch, a pool of the
    target's block size and count, so the target's block tables address both."""
    draft = spec.draft
    if target.batch is None and not _is_path(draft):   # a loaded single-stream model
        check_vocabulary(target.loaded.tokenizer, target.loaded.config.vocab_size, draft.loaded)
        return ModelDrafter(StreamKV(draft.executor, shared=False), "draft", owner=draft)
    if loaded is None:
        loaded = check_draft(target.loaded, target.ctx, spec, batched=target.batch is not None)
    if target.batch is None:
        built = build_executor(loaded, target.build, min(target.ctx, loaded.config.seq_len))
        return ModelDrafter(StreamKV(built.executor, shared=False), "draft", owner=built)
    built = build_executor(loaded, target.build, target.ctx, kv_type=target.kv_type, batch=target.batch)
    _check_pool(spec, built.executor, target.executor)
    return ModelDrafter(PagedKV(built.executor, own_pool=True), "draft", owner=built)


def _first_layers(target: DraftTarget, spec: Speculation) -> ModelDrafter:
    """The target's first ``k`` layers, final norm and head as a model of
    its own, compiled for the target's context, KV type (and pool), run on
    the target's KV cache: their state must come first in the same layout
    (checked)."""
    k = spec.draft_layers
    check_layers(k, target.loaded.config.n_layers)
    loaded = dataclasses.replace(target.loaded, config=dataclasses.replace(target.loaded.config, n_layers=k))
    b = target.build
    ex = target.executor
    if b.backend == "interp":
        graphs = build_graphs(loaded, CompileOptions(backend="interp", ctx=target.ctx, passes=b.passes,
                                                     kv_type=target.kv_type, batch=target.batch))
        draft = InterpExecutor(graphs, max_rows=ex.pool.max_rows if target.batch is not None else None)
        for name in draft.state:
            if name not in ex.state or draft.state[name].shape != ex.state[name].shape:
                raise SpeculationError(f"--draft-layers {k}: the draft's KV state {name} does not fit the target's")
            draft.state[name] = ex.state[name]
    else:
        from compiler.native import NativeOptions, compile_native

        from ..native import NativeExecutor

        res = compile_native(loaded, NativeOptions(ctx=target.ctx, use_cache=b.use_cache, passes=b.passes,
                                                   kv_type=target.kv_type, progress=b.status, batch=target.batch))
        man, tman = res.artifact.manifest, ex.manifest
        for name, off in man["state_offsets"].items():
            if (tman["state_offsets"].get(name) != off or target.batch is not None
                    and tman["batch"]["block_bytes"].get(name) != man["batch"]["block_bytes"][name]):
                raise SpeculationError(f"--draft-layers {k}: the draft's KV state {name} is not where the target's is")
        draft = NativeExecutor(res.artifact, target.loaded.path, ex.threads, state=ex.state)
    if target.batch is None:
        return ModelDrafter(StreamKV(draft, shared=True), "draft-layers")
    _check_pool(spec, draft, ex)
    return ModelDrafter(PagedKV(draft, own_pool=False), "draft-layers")


def _check_pool(spec: Speculation, draft, target) -> None:
    """The target's block tables must address the draft's pool, and a
    verify step's rows must fit the draft's steps."""
    a, b = draft.pool, target.pool
    if (a.block_size, a.n_blocks, a.max_blocks_per_seq, a.ctx, draft.max_batch) != \
            (b.block_size, b.n_blocks, b.max_blocks_per_seq, b.ctx, target.max_batch):
        what = f"--draft-layers {spec.draft_layers}" if spec.draft is None else "--draft"
        raise SpeculationError(f"{what}: the draft's KV pool is not shaped as the target's")
