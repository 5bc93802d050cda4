"""Context shift: how a stream goes on once it fills the context.

Without it a stream that reaches the context stops (``length``), as run.c
does. With it (opt-in: ``lmc chat --context-shift``, ``lmc serve
--context-shift``, ``runtime.load(context_shift=True)``) the first ``keep``
tokens stay (a system prompt stays obeyed), the oldest half of the rest is
dropped, and the stream goes on from the kept tokens at their new positions,
as llama.cpp's ``--context-shift`` with ``--keep N``. Where llama.cpp
rotates the kept keys in place, the callers here recompute the kept tokens'
KV rows (the rows before ``keep`` are unchanged and stay; the rest is one
prefill), which is exact with every KV type and cache layout: the tokens
after a shift are those a fresh run on the kept tokens gives.

This module holds the arithmetic both the single stream (``model``,
``chat``) and the batch engine (``engine.scheduler``) use, and the default
``keep`` of a conversation.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import RunError
from .prefix import common_prefix


def shift_tokens(ids: Sequence[int], keep: int, limit: int) -> tuple[list[int], int]:
    """``ids`` with the oldest half of what follows their first ``keep``
    dropped, as many times as it takes to be at most ``limit`` long; and
    how many tokens were dropped. Unchanged when they fit already."""
    ids = list(ids)
    if len(ids) <= limit:
        return ids, 0
    keep = max(0, int(keep))
    if keep >= limit:
        raise RunError(f"context shift: the first {keep} tokens, which every shift keeps (--keep, or the system "
                       f"prompt), leave no room in {limit} positions (lower --keep, or raise -c)")
    dropped = 0
    while len(ids) > limit:
        n = max(1, (len(ids) - keep) // 2)
        del ids[keep:keep + n]
        dropped += n
    return ids, dropped


def chat_keep(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Any = None) -> int:
    """The default ``keep`` of a conversation: the tokens its rendering
    holds before the first user message's text (the system prompt, or the
    one the template puts in its place, and the template's opening), found
    as what two renderings that differ only in that text share. 0 when the
    conversation has no user message."""
    system = [dict(m) for m in messages if m.get("role") == "system"][:1]
    kw = {"tools": tools} if tools else {}
    # probes no template writes itself (the contents are found in the rendered text)
    a = tokenizer.chat_ids(system + [{"role": "user", "content": "Xylophones?"}], True, **kw)
    b = tokenizer.chat_ids(system + [{"role": "user", "content": "Quasars!"}], True, **kw)
    return common_prefix(a, b)


def check_keep(keep: int | None, ctx: int, flag: str = "--keep") -> None:
    """A ``keep`` that leaves a shift something to drop: below ``ctx - 1``."""
    if keep is not None and not 0 <= keep < ctx - 1:
        raise RunError(f"{flag} {keep}: must be between 0 and the context minus 2 ({ctx - 2})")
