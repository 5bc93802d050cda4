"""The model's vocabulary as llguidance sees it: each token id's bytes.

llguidance computes a grammar's allowed tokens from the bytes every token
decodes to (``LLTokenizer``), so a GGUF or llama2.c vocabulary maps onto it
directly: no Hugging Face tokenizer is needed. Control tokens are marked
with a leading 0xFF byte, as llguidance's own llama.cpp bridge does, so a
grammar can never spell one out of text. Building the table walks the whole
vocabulary (0.1-0.5 s for 150k tokens), so it is made once per tokenizer
and kept on it.
"""
from __future__ import annotations

from typing import Any

import llguidance

#: marks a control token's bytes (llguidance's convention)
SPECIAL_PREFIX = b"\xff"


class _Vocabulary:
    """What ``llguidance.TokenizerWrapper`` reads from a tokenizer."""

    def __init__(self, tokenizer: Any, stop_ids: tuple[int, ...], vocab_size: int) -> None:
        n = min(len(tokenizer), vocab_size)
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        is_special = getattr(tokenizer, "is_special", None)
        for i in range(n):
            special = bool(is_special(i)) if is_special is not None else i in (tokenizer.bos_id, tokenizer.eos_id)
            if special:
                name = _piece_text(tokenizer, i)
                self.tokens.append(SPECIAL_PREFIX + name)
                self.special_token_ids.append(i)
            else:
                self.tokens.append(_piece_bytes(tokenizer, i))
        self.tokens += [b""] * (vocab_size - n)   # the model's rows past the tokenizer's: never allowed
        self.eos_token_id = stop_ids[0] if stop_ids else tokenizer.eos_id
        bos = getattr(tokenizer, "bos_id", None)
        self.bos_token_id = bos if bos is not None and bos >= 0 else None
        self._tokenizer = tokenizer
        #: plain pieces' bytes -> id, and the longest's length (``_longest_pieces``; built when first needed)
        self._piece_ids: dict[bytes, int] | None = None
        self._longest = 0

    def __call__(self, text: bytes | str) -> list[int]:
        """Token ids whose bytes are exactly ``text``, without BOS: llguidance
        tokenizes forced bytes with it and checks them against the grammar.
        The model's own tokenizer where its ids spell the text; where they do
        not (a llama2.c or sentencepiece vocabulary prepends a dummy " " to
        any text: a grammar forcing "x" then allowed " " and refused it on
        consuming), the longest vocabulary pieces, left to right."""
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        ids = list(self._tokenizer.encode(data.decode("utf-8", errors="replace"), bos=False))
        if b"".join(self.tokens[i] for i in ids if 0 <= i < len(self.tokens)) == data:
            return ids
        return self._longest_pieces(data) or ids

    def _longest_pieces(self, data: bytes) -> list[int] | None:
        """``data`` as the longest plain pieces that spell it, left to right;
        None where some byte has no piece."""
        if self._piece_ids is None:
            special = set(self.special_token_ids)
            self._piece_ids = {}
            for i, t in enumerate(self.tokens):
                if t and i not in special:
                    self._piece_ids.setdefault(t, i)
            self._longest = max(map(len, self._piece_ids), default=0)
        pieces = self._piece_ids
        out, at = [], 0
        while at < len(data):
            for n in range(min(self._longest, len(data) - at), 0, -1):
                i = pieces.get(data[at:at + n])
                if i is not None:
                    out.append(i)
                    at += n
                    break
            else:
                return None
        return out


def _piece_bytes(tokenizer: Any, i: int) -> bytes:
    piece = getattr(tokenizer, "token_to_piece", None)
    if piece is not None:
        return bytes(piece(i))
    return bytes(tokenizer.decode_bytes([i]))


def _piece_text(tokenizer: Any, i: int) -> bytes:
    """A control token's name (``<|im_end|>``): what it would print with ``special``."""
    piece = getattr(tokenizer, "token_to_piece", None)
    if piece is not None:
        got = bytes(piece(i, True))
        if got:
            return got
    return f"<ctrl{i}>".encode()


def ll_tokenizer(tokenizer: Any, stop_ids: tuple[int, ...], vocab_size: int) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of ``tokenizer`` (built once, kept on it)
    for a model of ``vocab_size`` logits. ``stop_ids``: the model's
    end-of-generation tokens, which end a grammar's output once it is complete."""
    key = (tuple(stop_ids), int(vocab_size))
    cached = getattr(tokenizer, "_lmc_ll_tokenizer", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    vocab = _Vocabulary(tokenizer, tuple(stop_ids), int(vocab_size))
    llt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), n_vocab=len(vocab.tokens),
                                 eos_token=list(stop_ids) or None)
    try:
        tokenizer._lmc_ll_tokenizer = (key, llt)
    except AttributeError:   # a tokenizer with __slots__: built again next time
        pass
    return llt
