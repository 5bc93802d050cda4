"""Building the drafter a ``Speculation`` asks for, beside a loaded target.

Kept apart from ``runtime.speculative`` (the drafting and acceptance rules)
because it loads and compiles models: a second model file for ``--draft``,
or the target's own first K layers for ``--draft-layers``, compiled as a
graph of K layers whose KV state is laid out as the target's first K
layers' and run on the target's cache itself.
"""
from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

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


def _draft_model(target: "Model", spec: Speculation) -> ModelDrafter:
    """A draft model file is read (not compiled) first: one of another
    vocabulary is refused before any compile work."""
    from compiler.driver import load_model

    from .model import Model

    draft = spec.draft
    loaded = draft.loaded if isinstance(draft, Model) else None
    if loaded is None:
        name = os.fspath(draft)
        if not os.path.exists(name):
            raise SpeculationError(f"--draft {name}: no such file")
        loaded = load_model(name, spec.draft_tokenizer)
    why = same_vocabulary(target.tokenizer, loaded.tokenizer)
    if why is None and loaded.config.vocab_size != target.config.vocab_size:
        why = f"{loaded.config.vocab_size} logits against the target's {target.config.vocab_size}"
    if why is not None:
        raise SpeculationError(f"--draft {os.path.basename(loaded.path)}: not the target's vocabulary ({why})")
    if not isinstance(draft, Model):
        b = target._build
        draft = Model(loaded, backend=b["backend"], threads=b["threads"], use_cache=b["use_cache"],
                      passes=b["passes"], status=b["status"], ctx=min(target.ctx, loaded.config.seq_len))
    return ModelDrafter(draft.executor, target.config.vocab_size, name="draft", owner=draft)


def _first_layers(target: "Model", k: int) -> ModelDrafter:
    """The target's first ``k`` layers, final norm and head as a model of
    its own, compiled for the target's context and KV type, run on the
    target's KV cache (its layers' state comes first in the same layout)."""
    n = target.config.n_layers
    if not 1 <= k < n:
        raise SpeculationError(f"--draft-layers {k}: the model has {n} layers (take 1 to {n - 1})")
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
