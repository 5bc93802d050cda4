"""llama2.c ``tokenizer.bin`` reader with run.c's encoder and decoder.

The goal is bit-for-bit agreement with karpathy/llama2.c ``run.c`` (the
``Tokenizer`` section: ``build_tokenizer``, ``encode``, ``decode`` and
``safe_printf``), so that prompts tokenize to the same ids and generated ids
print as the same text. The code is our own; only the behaviour is copied.

File format (little-endian), vocab_size is *not* stored::

    int32 max_token_length
    vocab_size times: float32 score, int32 len, len bytes of piece

Facts about the shipped vocabularies (checked on ../shared/models): tok512.bin
(512 pieces), aidreams_tok512.bin (512) and tokenizer.bin (32000) have no
duplicate pieces, no empty pieces, no NUL bytes inside pieces, ids 3..258 are
exactly ``<0x00>``..``<0xFF>`` and the piece " " exists. run.c looks pieces up
with qsort + bsearch, which for a duplicated piece may return any of its ids;
since no shipped file has duplicates, our dict keeps the lowest id.
"""

from __future__ import annotations

import codecs
import heapq
import operator
import os
import re
import struct
from pathlib import Path
from typing import Sequence

import numpy as np

from .chat_mixin import ChatTemplateMixin

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "Llama2cTokenizer",
    "StreamDecoder",
    "TokenizerError",
    "safe_piece",
]

BOS_ID = 1
EOS_ID = 2
# run.c starts the merge search at best_score = -1e10 and only takes a pair
# whose score is strictly greater, so pieces scoring <= -1e10 (or NaN) are
# never produced by a merge. -1e10 is exact in float32.
_MERGE_FLOOR = -1e10
# A sanity bound for max_token_length / piece lengths: real files use < 100.
_ABSURD_LEN = 1 << 16

# run.c: sscanf(piece, "<0x%02hhX>", &byte_val) == 1. The return value only
# counts the conversion, so the trailing '>' is never checked; %X skips
# leading whitespace and takes an optional sign within its width of 2.
# (glibc's handling of a "0x" prefix inside the field is not modelled; no
# piece in the shipped vocabularies starts with "<0x" other than <0x00>..<0xFF>.)
_BYTE_PIECE = re.compile(rb"<0x[ \t\n\v\f\r]*([+-][0-9A-Fa-f]|[0-9A-Fa-f]{1,2})")


class TokenizerError(ValueError):
    """A tokenizer file or a token id that cannot be used; one-line message."""


def _cstr(piece: bytes) -> bytes:
    """run.c treats pieces as C strings: everything after a NUL is invisible."""
    nul = piece.find(b"\0")
    return piece if nul < 0 else piece[:nul]


def _c_isprint_or_isspace(b: int) -> bool:
    # run.c never calls setlocale, so these are the "C" locale classes.
    return 0x20 <= b <= 0x7E or 0x09 <= b <= 0x0D


def safe_piece(piece: bytes) -> bytes:
    """What run.c's ``safe_printf`` writes for a decoded piece.

    It prints nothing for an empty piece or for a one-byte piece that is not
    printable/whitespace in the C locale (so raw bytes >= 0x80 from byte
    fallback tokens are dropped: run.c cannot print non-ASCII produced byte
    by byte), and printf("%s") stops at a NUL.
    """
    piece = _cstr(piece)
    if not piece:
        return b""
    if len(piece) == 1 and not _c_isprint_or_isspace(piece[0]):
        return b""
    return piece


class Llama2cTokenizer(ChatTemplateMixin):
    """A llama2.c BPE vocabulary with run.c's exact encode/decode.

    A tokenizer.bin carries no chat template: chats use ``plain`` unless
    one is chosen (``chat_template``)."""

    bos_id: int = BOS_ID
    eos_id: int = EOS_ID

    def __init__(
        self,
        vocab: list[bytes],
        scores: np.ndarray,
        max_token_length: int,
        name: str = "<tokenizer>",
    ) -> None:
        if len(vocab) != len(scores):
            raise TokenizerError(
                f"{name}: {len(vocab)} pieces but {len(scores)} scores"
            )
        self.name = name
        self.path: str | None = None
        self.vocab: list[bytes] = list(vocab)
        self.scores: np.ndarray = np.asarray(scores, dtype=np.float32)
        self.vocab_size: int = len(self.vocab)
        self.max_token_length: int = int(max_token_length)
        # Lookups and merges see pieces as run.c does (C strings).
        self._cvocab: list[bytes] = [_cstr(p) for p in self.vocab]
        self._lookup: dict[bytes, int] = {}
        for i, p in enumerate(self._cvocab):
            self._lookup.setdefault(p, i)  # lowest id wins (see module doc)
        # Python floats hold float32 values exactly, so comparisons match C.
        self._score_list: list[float] = [float(s) for s in self.scores]

    # ------------------------------------------------------------------ I/O

    @classmethod
    def from_file(
        cls, path: str | os.PathLike, vocab_size: int | None = None
    ) -> "Llama2cTokenizer":
        """Read a tokenizer.bin; vocab_size is the model's (None: read to EOF).

        The whole file is parsed so that a tokenizer built for a different
        vocabulary size is rejected instead of silently misaligning ids.
        """
        p = Path(path)
        name = p.name
        if vocab_size is not None:
            try:
                vocab_size = operator.index(vocab_size)  # accepts numpy ints
            except TypeError:
                raise TokenizerError(
                    f"{name}: invalid vocab_size {vocab_size!r}"
                ) from None
            if vocab_size <= 0:
                raise TokenizerError(f"{name}: invalid vocab_size {vocab_size}")
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            raise TokenizerError(f"{name}: file not found ({p})") from None
        except IsADirectoryError:
            raise TokenizerError(f"{name}: is a directory ({p})") from None
        except OSError as e:
            raise TokenizerError(f"{name}: cannot read ({e.strerror})") from None
        tok = cls.from_bytes(data, name, vocab_size)
        tok.path = str(p.resolve())  # artifacts record where their tokenizer is
        return tok

    @classmethod
    def from_bytes(cls, data: bytes, name: str, vocab_size: int | None = None) -> "Llama2cTokenizer":
        """Parse the bytes of a tokenizer.bin (a QSF file carries them)."""
        n = len(data)
        if n < 4:
            raise TokenizerError(
                f"{name}: truncated header (needs 4 bytes, {n} present)"
            )
        (max_token_length,) = struct.unpack_from("<i", data, 0)
        if not 0 < max_token_length <= _ABSURD_LEN:
            raise TokenizerError(
                f"{name}: absurd max_token_length {max_token_length}"
            )
        vocab: list[bytes] = []
        scores: list[float] = []
        off = 4
        expected_end = None  # offset where the model's vocab_size pieces end
        unpack = struct.Struct("<fi").unpack_from
        while off < n:
            i = len(vocab)
            if i == vocab_size:
                expected_end = off
            if n - off < 8:
                need, left, what = 8, n - off, " for score and length"
            else:
                score, length = unpack(data, off)
                off += 8
                if length < 0 or length > _ABSURD_LEN:
                    raise TokenizerError(
                        f"{name}: piece {i} has absurd length {length}"
                    )
                if length > max_token_length:
                    # run.c's merge buffer holds 2*max_token_length+3 bytes: a
                    # longer piece would overflow it, so the file is corrupt.
                    raise TokenizerError(
                        f"{name}: piece {i} has length {length} > "
                        f"max_token_length {max_token_length}"
                    )
                if n - off >= length:
                    vocab.append(data[off : off + length])
                    scores.append(score)
                    off += length
                    continue
                need, left, what = length, n - off, ""
            if expected_end is not None:
                raise TokenizerError(
                    f"{name}: {n - expected_end} trailing bytes after the "
                    f"model's {vocab_size} pieces (the file holds more pieces "
                    f"than vocab_size {vocab_size}, the last one incomplete)"
                )
            raise TokenizerError(
                f"{name}: truncated at piece {i} (needs {need} bytes{what}, "
                f"{left} left)"
            )

        if vocab_size is not None and len(vocab) != vocab_size:
            raise TokenizerError(
                f"{name}: has {len(vocab)} pieces but the model's vocab_size "
                f"is {vocab_size}"
            )
        if not vocab:
            raise TokenizerError(f"{name}: no pieces after the header")
        return cls(vocab, np.array(scores, dtype=np.float32), max_token_length, name)

    # ------------------------------------------------------------ basics

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (
            f"Llama2cTokenizer({self.name!r}, vocab_size={self.vocab_size}, "
            f"max_token_length={self.max_token_length})"
        )

    def _check_id(self, token: int) -> None:
        if not 0 <= token < self.vocab_size:
            raise TokenizerError(
                f"{self.name}: token id {token} out of range [0, {self.vocab_size})"
            )

    def id_to_piece(self, token: int) -> bytes:
        """The raw piece bytes of a token id, as stored in the file."""
        self._check_id(token)
        return self.vocab[token]

    def piece_to_id(self, piece: bytes) -> int | None:
        """The id run.c's lookup finds for a piece, or None."""
        return self._lookup.get(_cstr(piece))

    def chat_special_text(self, token_id: int) -> str:
        """A special token's text for chat templates: llama2.c's export
        stores BOS/EOS as "\\n<s>\\n" and "\\n</s>\\n" for display; templates
        want "<s>" and "</s>"."""
        if not 0 <= token_id < self.vocab_size:
            return ""
        return self.vocab[token_id].decode("utf-8", "replace").strip()

    # ------------------------------------------------------------ encode

    def _initial_tokens(self, data: bytes) -> list[int]:
        """Split bytes into codepoint tokens with byte fallback, as run.c does.

        run.c works on raw bytes, not on validated UTF-8: a group starts at any
        non-continuation byte and takes following continuation bytes (10xxxxxx)
        until it holds 4 bytes; stray continuation bytes form groups of up to
        4 on their own. A group not in the vocab becomes one token per byte,
        id byte + 3.
        """
        lookup = self._lookup
        out: list[int] = []
        n = len(data)
        start = 0
        length = 0
        for i in range(n):
            c = data[i]
            if (c & 0xC0) != 0x80:
                start, length = i, 0
            length += 1
            nxt = data[i + 1] if i + 1 < n else 0
            if (nxt & 0xC0) == 0x80 and length < 4:
                continue
            group = data[start : start + length]
            tid = lookup.get(group)
            if tid is not None:
                out.append(tid)
            else:
                for b in group:
                    if b + 3 >= self.vocab_size:
                        raise TokenizerError(
                            f"{self.name}: byte fallback id {b + 3} for byte "
                            f"0x{b:02X} is outside the vocabulary"
                        )
                    out.append(b + 3)
            # run.c resets here so a run of stray continuation bytes restarts
            start, length = i + 1, 0
        return out

    def _merge(self, tokens: list[int]) -> list[int]:
        """run.c's greedy BPE, made O(n log n).

        run.c repeatedly scans all adjacent pairs, merges the one whose
        concatenation is in the vocab with the highest score (strict '>', so
        the leftmost on ties; only scores > -1e10), and rescans. Here a heap
        keyed by (-score, position of the left token in the original
        sequence) gives the same choice: merges keep order, so the smallest
        original position is the leftmost current pair. Stale heap entries
        are detected with a per-slot version counter.
        """
        n = len(tokens)
        if n < 2:
            return list(tokens)
        cvocab = self._cvocab
        lookup = self._lookup
        scores = self._score_list
        tok = list(tokens)
        nxt = list(range(1, n + 1))  # n means "no next"
        prv = list(range(-1, n - 1))
        ver = [0] * n
        alive = [True] * n
        heap: list[tuple[float, int, int, int, int, int]] = []

        def push(i: int) -> None:
            j = nxt[i]
            if j >= n:
                return
            mid = lookup.get(cvocab[tok[i]] + cvocab[tok[j]])
            if mid is None:
                return
            s = scores[mid]
            if not s > _MERGE_FLOOR:  # also rejects NaN, like run.c's '>'
                return
            heapq.heappush(heap, (-s, i, j, ver[i], ver[j], mid))

        for i in range(n - 1):
            push(i)
        while heap:
            _, i, j, vi, vj, mid = heapq.heappop(heap)
            if not (alive[i] and alive[j] and nxt[i] == j
                    and ver[i] == vi and ver[j] == vj):
                continue
            tok[i] = mid
            ver[i] += 1
            alive[j] = False
            k = nxt[j]
            nxt[i] = k
            if k < n:
                prv[k] = i
            if prv[i] >= 0:
                push(prv[i])
            push(i)
        out = []
        i = 0
        while i < n:
            out.append(tok[i])
            i = nxt[i]
        return out

    def encode_segments(self, segments: Sequence[tuple[str, bool]], bos: bool = True) -> list[int]:
        """The pieces' text as one (a llama2.c vocabulary has no control tokens to tell apart)."""
        return self.encode("".join(t for t, _ in segments), bos=bos)

    def encode(self, text: str | bytes, bos: bool = True, eos: bool = False, special: bool = False) -> list[int]:
        """Token ids for text, exactly as run.c's ``encode(t, text, bos, eos)``.
        ``special`` is accepted for the common interface and changes nothing:
        run.c never reads control tokens (``<s>``) out of text.

        A str is encoded to UTF-8 with 'surrogateescape', so a command-line
        argument that Python decoded with os.fsdecode gets back the very bytes
        run.c would have seen in argv; bytes are used as they are. run.c reads
        a C string, so the text ends at the first NUL.
        """
        if isinstance(text, str):
            try:
                data = text.encode("utf-8", errors="surrogateescape")
            except UnicodeEncodeError as e:
                raise TokenizerError(
                    f"{self.name}: text is not encodable as UTF-8 at index "
                    f"{e.start} ({text[e.start]!r})"
                ) from None
        else:
            data = bytes(text)
        nul = data.find(b"\0")
        if nul >= 0:
            data = data[:nul]
        ids: list[int] = []
        if bos:
            ids.append(self.bos_id)
        if data:
            # add_dummy_prefix: run.c looks up " " and always prepends it for
            # non-empty text (even text that already starts with a space).
            space = self._lookup.get(b" ")
            if space is None:
                raise TokenizerError(f"{self.name}: no ' ' piece for the dummy prefix")
            ids.append(space)
            ids.extend(self._initial_tokens(data))
            # run.c merges over the whole array, BOS included (a no-op unless
            # some piece starts with BOS's piece "\n<s>\n"); EOS comes after.
            ids = self._merge(ids)
        if eos:
            ids.append(self.eos_id)
        return ids

    # ------------------------------------------------------------ decode

    def decode_piece(self, prev_token: int, token: int) -> bytes:
        """Bytes run.c's ``decode(t, prev_token, token)`` returns.

        After BOS a leading space is stripped (sentencepiece drops the dummy
        prefix); a ``<0xXX>`` piece stands for that raw byte.
        """
        self._check_id(token)
        piece = self.vocab[token]
        if prev_token == self.bos_id and piece[:1] == b" ":
            piece = piece[1:]
        m = _BYTE_PIECE.match(piece)
        if m:
            return bytes([int(m.group(1), 16) & 0xFF])
        return piece

    def decode_bytes(self, ids: list[int], safe: bool = False) -> bytes:
        """Concatenated decoded pieces; BOS ids are skipped (run.c never
        prints BOS) and the piece after a BOS loses its leading space.

        With safe=True every piece goes through run.c's safe_printf filter,
        giving byte for byte what run.c writes to stdout (minus its final
        newline).
        """
        out = bytearray()
        prev = -1  # the first piece follows nothing
        for t in ids:
            t = int(t)
            if t == self.bos_id:
                self._check_id(t)
                prev = t
                continue
            piece = self.decode_piece(prev, t)
            out += safe_piece(piece) if safe else piece
            prev = t
        return bytes(out)

    def decode(self, ids: list[int], safe: bool = False) -> str:
        """Text for ids; invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD."""
        return self.decode_bytes(ids, safe=safe).decode("utf-8", errors="replace")

    def stream_decoder(self, safe: bool = False) -> "StreamDecoder":
        """A StreamDecoder bound to this tokenizer."""
        return StreamDecoder(self, safe=safe)

    decode_stream = stream_decoder


class StreamDecoder:
    """Incremental decoding for printing token by token.

    Byte-fallback tokens can split one character over several tokens; feed()
    returns only complete characters and keeps the partial bytes for later.
    """

    def __init__(self, tokenizer: Llama2cTokenizer, safe: bool = False) -> None:
        self.tokenizer = tokenizer
        self.safe = safe
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, prev_token: int, token: int) -> str:
        """Text completed by token (which follows prev_token)."""
        if token == self.tokenizer.bos_id:
            return ""
        piece = self.tokenizer.decode_piece(prev_token, token)
        if self.safe:
            piece = safe_piece(piece)
        return self._dec.decode(piece)

    def flush(self) -> str:
        """Whatever is pending at the end (an incomplete character gives U+FFFD)."""
        return self._dec.decode(b"", final=True)
