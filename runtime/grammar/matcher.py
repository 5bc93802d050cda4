"""One sequence's place in its grammar: the tokens allowed next (a bitmask
the native sampler applies, ``compiler.codegen.k_sampler.mask_logits``),
each sampled token consumed, and whether the output is complete.

A matcher belongs to one sequence: a batched server step gives each of its
sequences its own. llguidance computes a mask in about 50 us for a 128k
vocabulary with the GIL released."""
from __future__ import annotations

import time
from typing import Any

import llguidance
import numpy as np

from .constraint import Constraint, ConstraintError, parser_limits
from .vocabulary import ll_tokenizer


class GrammarMatcher:
    """The allowed tokens of one generation under ``constraint``."""

    def __init__(self, constraint: Constraint, tokenizer: Any, stop_ids: tuple[int, ...], vocab_size: int,
                 grammar: str | None = None) -> None:
        """``grammar``: the constraint's compiled grammar when the caller
        already has it (``Constraint.grammar``)."""
        #: what it enforces (another process builds its own matcher from it: an lmc serve replica)
        self.constraint = constraint
        llt = ll_tokenizer(tokenizer, stop_ids, vocab_size)
        self.m = llguidance.LLMatcher(llt, grammar or constraint.grammar(), log_level=0, limits=parser_limits())
        if self.m.is_error():
            raise ConstraintError(f"{constraint.kind.replace('_', ' ')}: {self.m.get_error()}")
        self.words = np.zeros((vocab_size + 31) // 32, np.int32)
        self._first_token_fits(constraint)
        #: steps whose mask was computed, and the seconds spent on them (``/metrics``)
        self.steps = 0
        self.mask_s = 0.0
        #: tokens consumed, and how many had been when the output became complete (None: not yet)
        self.consumed = 0
        self.done_at: int | None = None

    def _first_token_fits(self, constraint: Constraint) -> None:
        """Refuse a grammar llguidance cannot follow (a regex past its lexer's
        limits, ``a{9999}``), now rather than at the first token: its mask
        then allows a token that consuming refuses. Served, it ended the
        request with an empty 200; now it is a 400 naming the limit."""
        self.m.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        allowed = np.flatnonzero(self.words)
        if not len(allowed):
            return
        w = int(allowed[0])
        first = w * 32 + (int(self.words[w]) & -int(self.words[w])).bit_length() - 1
        if self.m.try_consume_tokens([first]):
            self.m.rollback(1)
            return
        self.m.consume_token(first)     # refused: this sets the matcher's reason
        why = (self.m.get_error() or "").strip().splitlines()[:1] or ["refused"]
        raise ConstraintError(f"{constraint.kind.replace('_', ' ')}: cannot be enforced ({why[0]})")

    def mask(self) -> np.ndarray:
        """The allowed next tokens: int32 words, bit i % 32 of word i // 32."""
        t0 = time.perf_counter()
        self.m.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        self.mask_s += time.perf_counter() - t0
        self.steps += 1
        return self.words

    def accept(self, token: int) -> None:
        """Consume a sampled token (one the mask allowed)."""
        if not self.m.consume_token(int(token)):
            # llguidance's error is its first line; then a dump of the parser state
            why = (self.m.get_error() or "").strip().splitlines()[:1] or ["refused"]
            raise ConstraintError(f"token {token} does not fit the grammar: {why[0]}")
        self.consumed += 1
        if self.done_at is None and self.m.is_stopped():
            self.done_at = self.consumed

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (a draft) the grammar takes from here; its state is left unchanged."""
        n = self.m.try_consume_tokens([int(t) for t in tokens])
        if n:
            self.m.rollback(n)
        return n

    @property
    def done(self) -> bool:
        """The output is complete and nothing can follow (only an end-of-generation token)."""
        return self.m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.m.is_accepting()
