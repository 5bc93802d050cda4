"""Building the drafter a ``Speculation`` asks for, beside a loaded target.

Kept apart from ``runtime.speculative`` (the drafting and acceptance rules)
because it loads and compiles models: a second model file for ``--draft``,
or the target's own first K layers for ``--draft-layers``, compiled as a
graph of K layers whose KV state is laid out as the target's first K
layers' and run on the target's cache itself. For a target built for
batched serving (``lmc serve``), the same two drafters are compiled with
the paged batch steps (``build_pool_drafter``, ``runtime.pool_drafters``).
"""
from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from .pool_drafters import PoolModelDrafter
from .speculative import Drafter, LookupDrafter, ModelDrafter, Speculation, SpeculationError

if TYPE_CHECKING:
    from .model import Model


def build_drafter(target: "Model", spec: Speculation) -> Drafter:
    """The drafter of ``spec`` for ``target``; raises ``RunError`` (one line)
    for a draft of another vocabulary or more layers than the target has."""
    from .model import RunError

    try:
        if spec.lookup:
            return LookupDrafter(spec.lookup)
        if spec.draft is not None:
            return _draft_model(target, spec)
        return _first_layers(target, spec.draft_layers)
    except SpeculationError as e:
        raise RunError(str(e)) from None


def same_vocabulary(a, b) -> str | None:
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


def read_draft(spec: Speculation):
    """``spec.draft``'s model file, read (not compiled): a draft of another
    vocabulary is refused (``check_vocabulary``) before any compile work."""
    from compiler.driver import load_model

    name = os.fspath(spec.draft)
    if not os.path.exists(name):
        raise SpeculationError(f"--draft {name}: no such file")
    return load_model(name, spec.draft_tokenizer)


def check_vocabulary(target_tokenizer, target_vocab: int, draft) -> None:
    """Refuse a draft (a ``LoadedModel``) whose ids are not the target's."""
    why = same_vocabulary(target_tokenizer, draft.tokenizer)
    if why is None and draft.config.vocab_size != target_vocab:
        why = f"{draft.config.vocab_size} logits against the target's {target_vocab}"
    if why is not None:
        raise SpeculationError(f"--draft {os.path.basename(draft.path)}: not the target's vocabulary ({why})")


def check_layers(k: int, n_layers: int) -> None:
    if not 1 <= k < n_layers:
        raise SpeculationError(f"--draft-layers {k}: the model has {n_layers} layers (take 1 to {n_layers - 1})")


def _draft_model(target: "Model", spec: Speculation) -> ModelDrafter:
    from .model import Model

    draft = spec.draft
    loaded = draft.loaded if isinstance(draft, Model) else read_draft(spec)
    check_vocabulary(target.tokenizer, target.config.vocab_size, loaded)
    if not isinstance(draft, Model):
        b = target._build
        draft = Model(loaded, backend=b["backend"], threads=b["threads"], use_cache=b["use_cache"],
                      passes=b["passes"], status=b["status"], ctx=min(target.ctx, loaded.config.seq_len))
    return ModelDrafter(draft.executor, target.config.vocab_size, name="draft", owner=draft)


def _first_layers(target: "Model", k: int) -> ModelDrafter:
    """The target's first ``k`` layers, final norm and head as a model of
    its own, compiled for the target's context and KV type, run on the
    target's KV cache (its layers' state comes first in the same layout)."""
    check_layers(k, target.config.n_layers)
    loaded = dataclasses.replace(target.loaded, config=dataclasses.replace(target.config, n_layers=k))
    b = target._build
    ex = target.executor
    if b["backend"] == "interp":
        from compiler.driver import CompileOptions, build_graphs

        from .executor import InterpExecutor

        graphs = build_graphs(loaded, CompileOptions(backend="interp", ctx=target.ctx, passes=b["passes"],
                                                     kv_type=target.kv_type))
        draft = InterpExecutor(graphs)
        for name in draft.state:
            if draft.state[name].shape != ex.state[name].shape:
                raise SpeculationError(f"--draft-layers {k}: the draft's {name} does not fit the target's")
            draft.state[name] = ex.state[name]
        return ModelDrafter(draft, target.config.vocab_size, name="draft-layers", shared_cache=True)

    from compiler.native import NativeOptions, compile_native

    from .native import NativeExecutor

    res = compile_native(loaded, NativeOptions(ctx=target.ctx, use_cache=b["use_cache"], passes=b["passes"],
                                               kv_type=target.kv_type, progress=b["status"]))
    man, tman = res.artifact.manifest, ex.manifest
    for name, off in man["state_offsets"].items():
        if tman["state_offsets"].get(name) != off:
            raise SpeculationError(f"--draft-layers {k}: the draft's KV state {name} is not where the target's is")
    draft = NativeExecutor(res.artifact, target.loaded.path, ex.threads, state=ex.state)
    return ModelDrafter(draft, target.config.vocab_size, name="draft-layers", shared_cache=True)


# --- the batch engine's drafters (lmc serve) ---------------------------------------------------
def build_pool_drafter(target: "Model", spec: Speculation, draft_loaded=None) -> PoolModelDrafter:
    """The model drafter of ``spec`` (``draft`` or ``draft_layers``) for a
    ``target`` built for batched serving: run through the same paged batch
    steps, on a pool of its own of the target's shape or on the target's.
    ``draft_loaded``: the draft file already read (``read_draft``). Raises
    ``RunError`` (one line) as ``build_drafter`` does."""
    from .model import RunError

    try:
        if spec.draft is not None:
            return _pool_draft_model(target, spec, draft_loaded)
        return _pool_first_layers(target, spec.draft_layers)
    except SpeculationError as e:
        raise RunError(str(e)) from None


def check_pool_draft(target_loaded, ctx: int, spec: Speculation):
    """What can be refused before compiling anything: a missing draft file,
    another vocabulary, a shorter context, K outside the target's layers.
    Returns the draft file read (``--draft``) or None; raises ``RunError``."""
    from .model import RunError

    try:
        if spec.draft is None:
            check_layers(spec.draft_layers, target_loaded.config.n_layers)
            return None
        loaded = read_draft(spec)
        check_vocabulary(target_loaded.tokenizer, target_loaded.config.vocab_size, loaded)
        if loaded.config.seq_len < ctx:
            raise SpeculationError(f"--draft {os.path.basename(loaded.path)}: its context is {loaded.config.seq_len} "
                                   f"positions, less than the server's {ctx} (lower -c)")
        return loaded
    except SpeculationError as e:
        raise RunError(str(e)) from None


def _pool_draft_model(target: "Model", spec: Speculation, loaded) -> PoolModelDrafter:
    """A second model with its own pool: the same block size and count, so
    the target's block tables address both."""
    from .model import Model

    if loaded is None:
        loaded = check_pool_draft(target.loaded, target.ctx, spec)
    b = target._build
    draft = Model(loaded, backend=b["backend"], threads=b["threads"], use_cache=b["use_cache"], passes=b["passes"],
                  status=b["status"], ctx=target.ctx, kv_type=target.kv_type, batch=target.batch)
    _check_pool(spec, draft.executor, target.executor)
    return PoolModelDrafter(draft.executor, "draft", own_pool=True, owner=draft)


def _pool_first_layers(target: "Model", k: int) -> PoolModelDrafter:
    """The target's first ``k`` layers, final norm and head, compiled with
    the paged batch steps and run on the target's pool: their KV state must
    be laid out exactly as the target's first layers' (checked)."""
    check_layers(k, target.config.n_layers)
    loaded = dataclasses.replace(target.loaded, config=dataclasses.replace(target.config, n_layers=k))
    b = target._build
    ex = target.executor
    spec = Speculation(draft_layers=k)
    if b["backend"] == "interp":
        from compiler.driver import CompileOptions, build_graphs

        from .executor import InterpExecutor

        graphs = build_graphs(loaded, CompileOptions(backend="interp", ctx=target.ctx, passes=b["passes"],
                                                     kv_type=target.kv_type, batch=target.batch))
        draft = InterpExecutor(graphs, max_rows=ex.pool.max_rows)
        for name in draft.state:
            if name not in ex.state or draft.state[name].shape != ex.state[name].shape:
                raise SpeculationError(f"--draft-layers {k}: the draft's KV state {name} does not fit the target's")
            draft.state[name] = ex.state[name]
        _check_pool(spec, draft, ex)
        return PoolModelDrafter(draft, "draft-layers", own_pool=False)

    from compiler.native import NativeOptions, compile_native

    from .native import NativeExecutor

    res = compile_native(loaded, NativeOptions(ctx=target.ctx, use_cache=b["use_cache"], passes=b["passes"],
                                               kv_type=target.kv_type, progress=b["status"], batch=target.batch))
    man, tman = res.artifact.manifest, ex.manifest
    for name, off in man["state_offsets"].items():
        if (tman["state_offsets"].get(name) != off
                or tman["batch"]["block_bytes"].get(name) != man["batch"]["block_bytes"][name]):
            raise SpeculationError(f"--draft-layers {k}: the draft's KV state {name} is not where the target's is")
    draft = NativeExecutor(res.artifact, target.loaded.path, ex.threads, state=ex.state)
    _check_pool(spec, draft, ex)
    return PoolModelDrafter(draft, "draft-layers", own_pool=False)


def _check_pool(spec: Speculation, draft, target) -> None:
    """The target's block tables must address the draft's pool, and a
    verify step's rows must fit the draft's steps."""
    a, b = draft.pool, target.pool
    if (a.block_size, a.n_blocks, a.max_blocks_per_seq, a.ctx, draft.max_batch) != \
            (b.block_size, b.n_blocks, b.max_blocks_per_seq, b.ctx, target.max_batch):
        what = f"--draft-layers {spec.draft_layers}" if spec.draft is None else "--draft"
        raise SpeculationError(f"{what}: the draft's KV pool is not shaped as the target's")
