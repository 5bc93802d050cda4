"""Speculative decoding: a drafter proposes tokens, the target checks them
all in one batched pass and keeps what it would have produced itself.

Decoding one token reads every weight once; checking k drafted tokens in one
``verify`` step reads them once for k + 1 rows, so each accepted draft is a
token almost for free. One drafter interface (``protocol.Drafter``) serves a
single stream (``Model.generate``) and the batch engine (``lmc serve``):

* ``LookupDrafter`` (``--lookup N``, ``lookup``): prompt lookup.
* ``ModelDrafter`` (``model_drafter``) over a smaller model of the same
  vocabulary (``--draft``), with a KV cache of its own; or over the
  target's own first K layers plus its final norm and head
  (``--draft-layers``), whose KV rows for those layers are the target's own.
  Where its rows live, one stream's cache or a paged pool, is ``draft_kv``'s.

``build.build_drafter`` makes the one a ``Speculation`` asks for;
``acceptance.accept`` is the rule the target keeps drafts by, and
``draft_length.DraftLength`` how many to draft next. The KV cache is
indexed by position and attention reads only rows below a step's
positions, so rolling back past a rejected token is setting the position:
the next step overwrites the stale rows.
"""
from .acceptance import accept, draft_sampler, grammar_checked, sample_draft
from .config import DEFAULT_DRAFT_MAX, MAX_DRAFT_MAX, Speculation, SpeculationError
from .draft_length import DraftLength
from .lookup import LookupDrafter, lookup_continuation
from .model_drafter import ModelDrafter
from .protocol import ONE_STREAM, Draft, Drafter, DraftRoom, DraftSeq, StreamSeq

__all__ = ["grammar_checked", "DEFAULT_DRAFT_MAX", "MAX_DRAFT_MAX", "ONE_STREAM", "Draft", "DraftLength", "DraftRoom", "DraftSeq",
           "Drafter", "LookupDrafter", "ModelDrafter", "Speculation", "SpeculationError", "StreamSeq", "accept",
           "draft_sampler", "lookup_continuation", "sample_draft"]
