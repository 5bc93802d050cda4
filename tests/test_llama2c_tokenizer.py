"""Tests for frontends.llama2c_tokenizer against llama2.c run.c behaviour."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontends.llama2c_tokenizer import (
    Llama2cTokenizer,
    StreamDecoder,
    TokenizerError,
    safe_piece,
)

from shared_data import MODELS, REFERENCE, SHARED, needs_shared  # noqa: F401


_CACHE: dict[str, Llama2cTokenizer] = {}


def load(name: str) -> Llama2cTokenizer:
    """Each shared tokenizer parsed once per session."""
    if name not in _CACHE:
        size = {"tok512.bin": 512, "tokenizer.bin": 32000}[name]
        _CACHE[name] = Llama2cTokenizer.from_file(MODELS / name, vocab_size=size)
    return _CACHE[name]


@pytest.fixture
def tok512() -> Llama2cTokenizer:
    return load("tok512.bin")


@pytest.fixture
def tok32k() -> Llama2cTokenizer:
    return load("tokenizer.bin")


def write_tokenizer(path: Path, pieces: list[bytes], scores=None, mtl=None) -> Path:
    """A llama2.c tokenizer.bin with the given pieces."""
    scores = scores if scores is not None else [0.0] * len(pieces)
    mtl = mtl if mtl is not None else max(len(p) for p in pieces)
    out = bytearray(struct.pack("<i", mtl))
    for s, p in zip(scores, pieces):
        out += struct.pack("<fi", s, len(p)) + p
    path.write_bytes(bytes(out))
    return path


def naive_encode(tok: Llama2cTokenizer, data: bytes, bos: bool, eos: bool) -> list[int]:
    """run.c's encode() transcribed literally: byte loop, then O(n^2) merges."""
    lookup: dict[bytes, int] = {}
    for i, p in enumerate(tok.vocab):
        lookup.setdefault(p, i)
    scores = tok.scores
    nul = data.find(b"\0")
    if nul >= 0:
        data = data[:nul]
    tokens = [1] if bos else []
    if data:
        tokens.append(lookup[b" "])
    buf = b""
    for i, c in enumerate(data):
        if (c & 0xC0) != 0x80:
            buf = b""
        buf += bytes([c])
        nxt = data[i + 1] if i + 1 < len(data) else 0
        if (nxt & 0xC0) == 0x80 and len(buf) < 4:
            continue
        if buf in lookup:
            tokens.append(lookup[buf])
        else:
            tokens.extend(b + 3 for b in buf)
        buf = b""
    # run.c's merge loop runs over the whole array, BOS included.
    while True:
        best_score = np.float32(-1e10)
        best_id = best_idx = -1
        for i in range(len(tokens) - 1):
            tid = lookup.get(tok.vocab[tokens[i]] + tok.vocab[tokens[i + 1]], -1)
            if tid != -1 and scores[tid] > best_score:
                best_score, best_id, best_idx = scores[tid], tid, i
        if best_idx == -1:
            break
        tokens[best_idx : best_idx + 2] = [best_id]
    if eos:
        tokens.append(2)
    return tokens


def _cases(name: str) -> list[dict]:
    path = REFERENCE / name
    if not path.exists():
        return []
    return json.loads(path.read_text())["cases"]


REF_CASES = [
    pytest.param(c, id=f"{name.split('_')[1]}-{i}")
    for name in ("stories260K_runc.json", "stories260K_q8_runq.json")
    for i, c in enumerate(_cases(name))
]


# --------------------------------------------------------------- references


@needs_shared
@pytest.mark.parametrize("case", REF_CASES)
def test_reference_prompt_ids(tok512: Llama2cTokenizer, case: dict) -> None:
    assert tok512.encode(case["prompt"], bos=True) == case["prompt_ids"]


@needs_shared
@pytest.mark.parametrize("case", REF_CASES)
def test_reference_text(tok512: Llama2cTokenizer, case: dict) -> None:
    # run.c prints decode(prev, next) for every prompt token after BOS and
    # every generated token, stops before printing a sampled BOS, then
    # printf("\n"). So its stdout is exactly decode(all ids) + "\n". (The only
    # byte token in these generations is <0x0A>, which safe_printf keeps, so
    # the safe and unfiltered decodings agree here.)
    ids = case["prompt_ids"] + case["generated_ids"]
    if ids[-1] == 1:
        ids = ids[:-1]
    assert case["text"] == tok512.decode(ids) + "\n"
    assert case["text"] == tok512.decode(ids, safe=True) + "\n"
    stream = StreamDecoder(tok512, safe=True)
    printed = "".join(stream.feed(p, t) for p, t in zip(ids, ids[1:]))
    assert printed + stream.flush() + "\n" == case["text"]


@needs_shared
def test_llama_spm_conformance_strings(tok32k: Llama2cTokenizer) -> None:
    # llama.cpp's SentencePiece results for the Llama 2 vocabulary (no BOS):
    # run.c's greedy merge agrees with all of them.
    vocab_dir = SHARED / "vocab"
    inp = (vocab_dir / "ggml-vocab-llama-spm.gguf.inp").read_text(encoding="utf-8")
    out = (vocab_dir / "ggml-vocab-llama-spm.gguf.out").read_text().split("\n")
    strings = inp.split("\n__ggml_vocab_test__\n")
    assert len(strings) == len(out) == 47
    for s, line in zip(strings, out):
        assert tok32k.encode(s, bos=False) == [int(x) for x in line.split()], repr(s)


# ----------------------------------------------------------- explicit cases


@needs_shared
def test_tokenizer_bin_unicode_and_byte_fallback(tok32k: Llama2cTokenizer) -> None:
    t = tok32k
    assert len(t) == 32000 and t.max_token_length == 27
    space = 29871
    assert t.vocab[space] == b" "
    assert t.encode("") == [1]
    assert t.encode("", bos=False, eos=True) == [2]
    assert t.encode("Hello world", bos=True, eos=True) == [1, 15043, 3186, 2]
    # Llama (U+1F999) is not a piece: 4 byte-fallback ids F0 9F A6 99 (+3).
    assert t.encode("🦙", bos=False) == [space, 243, 162, 169, 156]
    assert t.encode(" this is 🦙.cpp", bos=False) == [
        29871, 445, 338, 29871, 243, 162, 169, 156, 29889, 8223]
    assert t.encode("Äpfel", bos=False) == [11585, 7810, 295]  # " Ä" "pf" "el"
    # run.c groups a lead byte with up to 3 following continuation bytes even
    # when that is not valid UTF-8: "ä" + stray 0x80 is one 3-byte group, not
    # a piece, so all three bytes fall back (a validating decoder would give
    # "ä" and one fallback byte).
    assert t.encode("ä", bos=False) == [7533]  # " ä"
    assert t.encode(b"\xc3\xa4\x80", bos=False) == [space, 0xC3 + 3, 0xA4 + 3, 0x80 + 3]
    assert t.encode(b"\xff", bos=False) == [space, 0xFF + 3]
    # A str with surrogate escapes (os.fsdecode of argv) means the raw bytes.
    assert t.encode("\udcc3\udca4\udc80", bos=False) == t.encode(b"\xc3\xa4\x80", bos=False)
    # A lone surrogate that is not an escaped byte has no UTF-8 form.
    with pytest.raises(TokenizerError, match="not encodable"):
        t.encode("a\ud800")
    # The text is a C string for run.c: it ends at NUL.
    assert t.encode("ab\0cd") == t.encode("ab")


@needs_shared
def test_decode_piece(tok32k: Llama2cTokenizer) -> None:
    t = tok32k
    hello = 15043  # " Hello"
    assert t.decode_piece(1, hello) == b"Hello"
    assert t.decode_piece(3186, hello) == b" Hello"
    assert t.decode_piece(1, 0x0A + 3) == b"\n"
    assert t.decode_piece(5, 0xF0 + 3) == b"\xf0"
    assert t.id_to_piece(0xF0 + 3) == b"<0xF0>"
    assert t.decode([1, hello, 3186]) == "Hello world"
    assert t.decode([hello, 3186]) == " Hello world"
    # A byte sequence cut in the middle of a character decodes with U+FFFD.
    assert t.decode([1, 29871, 243, 162]) == "\ufffd"
    # run.c's safe_printf drops one-byte pieces that are not printable ASCII.
    assert safe_piece(b"\xf0") == b"" and safe_piece(b"\n") == b"\n"
    assert safe_piece(b"\x07") == b"" and safe_piece(b"ab") == b"ab"
    assert t.decode([1, 29871, 243, 162, 169, 156], safe=True) == ""
    with pytest.raises(TokenizerError, match="out of range"):
        t.decode_piece(1, 32000)
    with pytest.raises(TokenizerError, match="out of range"):
        t.decode([-1])


@needs_shared
def test_stream_decoder(tok32k: Llama2cTokenizer) -> None:
    text = "héllo 🦙 wörld, 日本語!"
    ids = tok32k.encode(text)
    stream = tok32k.stream_decoder()
    chunks = [stream.feed(p, t) for p, t in zip(ids, ids[1:])]
    assert "".join(chunks) + stream.flush() == text
    assert all("\ufffd" not in c for c in chunks)
    assert "" in chunks  # the first bytes of the llama emoji print nothing yet


@needs_shared
def test_long_prompt_is_fast(tok32k: Llama2cTokenizer, tok512: Llama2cTokenizer) -> None:
    text = (SHARED / "eval" / "stories_eval.txt").read_text(encoding="utf-8")
    text = (text + " Ünïcødé 🦙 ") * 2  # about 6.8k characters
    for t in (tok32k, tok512):
        t0 = time.perf_counter()
        ids = t.encode(text)
        assert time.perf_counter() - t0 < 0.5
        assert t.decode(ids) == text
    short = text[:400]
    for t in (tok32k, tok512):
        assert t.encode(short) == naive_encode(t, short.encode(), True, False)


# ------------------------------------------------------- fast == run.c naive

# Texts built from vocabulary pieces produce many merge candidates and ties.
def _piece_text(tok_name: str) -> st.SearchStrategy[bytes]:
    path = MODELS / tok_name
    if not path.exists():
        return st.just(b"")
    pieces = [p for p in load(tok_name).vocab[259:] if p]
    return st.lists(st.sampled_from(pieces), max_size=40).map(b"".join)


TEXTS = {
    "tok512.bin": st.one_of(
        st.text(max_size=80),
        st.text(alphabet="abcdefghijklmnopqrstuvwxyz ,.\n'\"Tt", max_size=120),
        st.binary(max_size=40),
        _piece_text("tok512.bin"),
    ),
    "tokenizer.bin": st.one_of(
        st.text(max_size=80),
        st.binary(max_size=40),
        _piece_text("tokenizer.bin"),
    ),
}


@needs_shared
@pytest.mark.parametrize("name", ["tok512.bin", "tokenizer.bin"])
@settings(max_examples=250, deadline=None, database=None)
@given(data=st.data())
def test_fast_merge_equals_runc_greedy(name: str, data: st.DataObject) -> None:
    tok = load(name)
    raw = data.draw(TEXTS[name])
    if isinstance(raw, str):
        b = raw.encode("utf-8")
        assert tok.encode(raw) == naive_encode(tok, b, True, False)
    else:
        b = raw
    bos = data.draw(st.booleans())
    eos = data.draw(st.booleans())
    assert tok.encode(b, bos=bos, eos=eos) == naive_encode(tok, b, bos, eos)


# ---------------------------------------------------------------- round trip


@needs_shared
@pytest.mark.parametrize("name", ["tok512.bin", "tokenizer.bin"])
@settings(max_examples=200, deadline=None, database=None)
@given(s=st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=60))
def test_round_trip(name: str, s: str) -> None:
    # The dummy prefix " " is always the start of the first token after BOS,
    # and decode strips one leading space after BOS, so with BOS every text
    # without NUL (or surrogates) comes back exactly, even one starting with
    # spaces or needing byte fallback. Without BOS the prefix space stays.
    tok = load(name)
    assert tok.decode(tok.encode(s, bos=True)) == s
    assert tok.decode(tok.encode(s, bos=False)) == (" " + s if s else "")


# ----------------------------------------------------------------- bad input


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"nope\.bin: file not found"):
        Llama2cTokenizer.from_file(tmp_path / "nope.bin")


def test_synthetic_file_and_bad_lengths(tmp_path: Path) -> None:
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [b"<0x%02X>" % i for i in range(256)]
    pieces += [b" ", b"a", b"b", b" a", b"ab", b" ab"]
    scores = [0.0] * 259 + [-10.0, -11.0, -12.0, -1.0, -1.0, -0.5]
    path = write_tokenizer(tmp_path / "tiny.bin", pieces, scores)
    t = Llama2cTokenizer.from_file(path, vocab_size=len(pieces))
    assert t.vocab == pieces and t.scores.dtype == np.float32
    # " a" and "ab" tie at -1.0: the leftmost pair (" " + "a") wins, then
    # " a" + "b" = " ab".
    assert t.encode("ab") == [1, 264]
    assert t.encode("ba", bos=False) == [259, 261, 260]

    data = bytearray(path.read_bytes())
    struct.pack_into("<i", data, 4 + 4, -5)  # length of piece 0
    bad = tmp_path / "neg.bin"
    bad.write_bytes(bytes(data))
    with pytest.raises(TokenizerError, match=r"neg\.bin: piece 0 has absurd length -5"):
        Llama2cTokenizer.from_file(bad)

    data = bytearray(path.read_bytes())
    struct.pack_into("<i", data, 0, -1)
    bad.write_bytes(bytes(data))
    with pytest.raises(TokenizerError, match=r"neg\.bin: absurd max_token_length -1"):
        Llama2cTokenizer.from_file(bad)

    bad.write_bytes(b"\x07\x00")
    with pytest.raises(TokenizerError, match=r"neg\.bin: truncated header"):
        Llama2cTokenizer.from_file(bad)

    short = write_tokenizer(tmp_path / "short.bin", pieces, scores, mtl=2)
    with pytest.raises(TokenizerError, match=r"short\.bin: piece 0 has length 5 > max_token_length 2"):
        Llama2cTokenizer.from_file(short)


@needs_shared
def test_truncated_copy(tmp_path: Path) -> None:
    data = (MODELS / "tok512.bin").read_bytes()
    bad = tmp_path / "tok512.bin"
    bad.write_bytes(data[:-2])  # the last piece loses 2 of its bytes
    with pytest.raises(TokenizerError) as e:
        Llama2cTokenizer.from_file(bad, vocab_size=512)
    msg = str(e.value)
    assert msg.startswith("tok512.bin: truncated at piece 511 (needs ")
    assert "\n" not in msg
    bad.write_bytes(data[:4 + 3])  # inside the first score/length header
    with pytest.raises(TokenizerError, match=r"tok512\.bin: truncated at piece 0 \(needs 8 bytes"):
        Llama2cTokenizer.from_file(bad)


@needs_shared
def test_vocab_size_mismatch(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tok512\.bin: has 512 pieces but the model's vocab_size is 32000"):
        Llama2cTokenizer.from_file(MODELS / "tok512.bin", vocab_size=32000)
    with pytest.raises(TokenizerError, match=r"tokenizer\.bin: has 32000 pieces but the model's vocab_size is 512"):
        Llama2cTokenizer.from_file(MODELS / "tokenizer.bin", vocab_size=512)
    padded = tmp_path / "padded.bin"
    padded.write_bytes((MODELS / "tok512.bin").read_bytes() + b"xyz")
    with pytest.raises(TokenizerError, match=r"padded\.bin: 3 trailing bytes after the model's 512 pieces"):
        Llama2cTokenizer.from_file(padded, vocab_size=512)
    with pytest.raises(TokenizerError, match=r"padded\.bin: truncated at piece 512"):
        Llama2cTokenizer.from_file(padded)
