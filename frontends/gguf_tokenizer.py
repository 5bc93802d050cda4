r"""Tokenizers built from GGUF metadata, with llama.cpp's encode and decode.

The goal is id-for-id agreement with llama.cpp (``src/llama-vocab.cpp`` and
``src/unicode.cpp``): ``llama_tokenize(text, add_special, parse_special)`` and
``llama_token_to_piece``. The code is our own; only the behaviour is copied.

Two tokenizer models are supported (``tokenizer.ggml.model``):

* ``"llama"`` -- SentencePiece-style (SPM): optional space prefix, spaces
  written as U+2581, then bigram merges by highest score (a priority queue of
  adjacent symbol pairs whose concatenation is a token, ties to the leftmost
  pair), and ``<0xXX>`` byte fallback for characters that are not tokens.
  Llama 2, Mistral v1, TinyStories and Gemma 3 (262144 pieces) use it.
* ``"gpt2"`` -- byte-level BPE: a pre-tokenizer (a list of regexes chosen by
  ``tokenizer.ggml.pre``) splits the text into words, every word's UTF-8 bytes
  are written with GPT-2's bytes-to-unicode alphabet, and pairs merge by rank
  from ``tokenizer.ggml.merges``. GPT-2, Llama 3, Qwen 2, DeepSeek and others.

How llama.cpp runs the pre-tokenizer regexes is reproduced, not just the
regexes: for gpt-2/llama-3 style patterns it uses hand-written splitters
equivalent to the regexes, and otherwise ``std::regex`` on a "collapsed" copy
of the text where every non-ASCII character is replaced by one byte standing
for its Unicode category (letter, number, punctuation, mark, symbol, other,
whitespace) and ``\\p{..}`` by the matching class. We do the same with the
standard ``re`` module (ASCII semantics, like std::regex in the C locale), so
approximations such as ``[^a-z]`` for "uppercase letter" behave as in
llama.cpp, and no third-party regex module is needed. Category data comes from
Python's ``unicodedata``; llama.cpp's tables may be a newer Unicode version, so
characters assigned very recently can differ.

Special tokens: the text is first split at special tokens, longest first
(llama.cpp ``tokenizer_st_partition``). USER_DEFINED tokens (e.g. Gemma's
runs of newlines, tabs and spaces, html tags) are always split out; CONTROL
tokens (``<start_of_turn>``, ``<|im_end|>``, ...) only with ``special=True``
(llama.cpp's ``parse_special``). The default is ``special=False``, which is
how the reference ids in ../shared were produced (gemma270m_tokenize.json says
parse_special=False; the vocab .inp strings contain no special tokens, so both
settings give the .out ids). Pass ``special=True`` to encode a chat template.

Decoding follows ``llama_token_to_piece``: U+2581 -> space (SPM), GPT-2
alphabet -> bytes (BPE), ``<0xXX>`` byte tokens -> that byte, user-defined
tokens -> their text, control/unknown/unused tokens -> nothing unless
``special=True``. With ``add_space_prefix`` the leading space that encode
added is removed again: from the first piece of the sequence and from a piece
that follows BOS or another special token (where encode adds the prefix).
llama.cpp's ``clean_up_tokenization_spaces`` pass (" ," -> ",") is *not*
applied, so that decode(encode(s)) == s.

Deliberate differences from llama.cpp, all on inputs the references don't
exercise: a vocabulary with duplicate pieces loads (the lowest id wins)
instead of being rejected; a BPE piece with characters outside the GPT-2
alphabet decodes to those characters' UTF-8 rather than llama.cpp's
``[UNK_BYTE_0x..]`` text. As in SentencePiece and llama.cpp, a literal U+2581
in the text of an SPM vocabulary decodes as a space.

Checked against llama.cpp itself (the xllamacpp bindings' server, a 2026
build): thousands of random strings, with and without add_special and
parse_special, give the same ids for the llama-spm, qwen2 and gpt-2
vocabularies, Gemma 3, and the gpt-2 vocabulary under each pre-tokenizer
listed in ``_PRE_TYPES``; so does every assigned code point (Unicode 14) for
the main pre-tokenizers. That build counts '~' as a symbol in ``\p{S}``
(older llama.cpp did not; this only matters for deepseek-v3 style regexes).

Like llama.cpp, tokens found by their text as end-of-generation (a fixed
list: ``<|im_end|>``, ``<end_of_turn>``, ``<|endoftext|>``, ``</s>``, ...)
are made control tokens and stop tokens, whatever their type in the file.
One consequence copied on purpose: Gemma 3's html tag ``</s>`` (id 212,
user-defined) and Qwen 2's BPE piece ``</s>`` (id 128247) are stop tokens,
print as nothing, and are not split out of text unless ``special=True``.

Loading: metadata comes from ``frontends.gguf.read_gguf`` (the gguf
package's reader, with its results cached on disk: ~9 s the first time for
Gemma's 262144 pieces, milliseconds after). Pieces stay one UTF-8 blob with
a hash index (``frontends.string_table``), and symbols are matched as bytes:
Gemma's vocabulary costs ~11 MB instead of ~60 MB of per-piece Python
objects, for lookups a few times slower than a dict's.
"""

from __future__ import annotations

import codecs
import heapq
import os
import re
import unicodedata
from array import array
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from .chat_mixin import ChatTemplateMixin
from .llama2c_tokenizer import TokenizerError
from .string_table import StringArray

__all__ = [
    "GGUFTokenizer",
    "GGUFStreamDecoder",
    "TokenizerError",
    "bpe_pre_split",
]

# --------------------------------------------------------------------------
# token types and attributes (llama.cpp's llama_token_type / llama_token_attr)

TT_UNDEFINED, TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = range(7)

A_UNKNOWN = 1 << 0
A_UNUSED = 1 << 1
A_NORMAL = 1 << 2
A_CONTROL = 1 << 3
A_USER_DEFINED = 1 << 4
A_BYTE = 1 << 5
A_LSTRIP = 1 << 7
A_RSTRIP = 1 << 8

_TYPE_TO_ATTR = np.array([0, A_NORMAL, A_UNKNOWN, A_CONTROL, A_USER_DEFINED, A_UNUSED, A_BYTE], dtype=np.int64)
_SPECIAL_ATTRS = A_CONTROL | A_USER_DEFINED | A_UNKNOWN

# Texts llama.cpp treats as end of generation (special_eog_ids), and as EOT
# when tokenizer.ggml.eot_token_id is absent.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
              "<end_of_utterance>")
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
              "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
              "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
              "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[")
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)

_SPACE_ESC = "\u2581"  # ▁

# one UTF-8 encoded character (the input is valid UTF-8)
_UTF8_CHARS = re.compile(rb"[\x00-\x7f]|[\xc0-\xff][\x80-\xbf]*")

# --------------------------------------------------------------------------
# GPT-2 byte <-> unicode alphabet


def _bytes_to_unicode() -> list[str]:
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = [""] * 256
    for b in keep:
        table[b] = chr(b)
    n = 0
    for b in range(256):
        if not table[b]:
            table[b] = chr(256 + n)
            n += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in enumerate(_BYTE_TO_CHAR)}
# bytes.translate can't map to multi-char strings; decode latin-1 then str.translate
_BYTE_ENCODE_TABLE = {b: _BYTE_TO_CHAR[b] for b in range(256)}

# --------------------------------------------------------------------------
# llama.cpp's unicode_regex_split, reproduced with the re module

# Unicode White_Space (llama.cpp's unicode_set_whitespace)
_WHITESPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                         0x2028, 0x2029, 0x202F, 0x205F, 0x3000])

# collapsed stand-ins for non-ASCII characters of each category
_C_NUMBER, _C_LETTER, _C_PUNCT, _C_MARK, _C_SYMBOL, _C_OTHER = "\xd1", "\xd2", "\xd3", "\xd4", "\xd5", "\xd0"
_CAT_CHAR = {"N": _C_NUMBER, "L": _C_LETTER, "P": _C_PUNCT, "M": _C_MARK, "S": _C_SYMBOL}
# \p{X} -> collapsed char + the ASCII members of the category (k_ucat_map)
_UCAT_CLASS = {
    "N": _C_NUMBER + "0-9",
    "L": _C_LETTER + "A-Za-z",
    "P": _C_PUNCT + r"!-#%-*,-/:-;?-@\[-\]_\{\}",
    "M": _C_MARK,
    "S": _C_SYMBOL + r"\$\+<->\^`\|~",  # recent llama.cpp added '~'; older builds lack it
}
_UCAT_NAMES = {"N": "N", "L": "L", "P": "P", "M": "M", "S": "S",
               "Lu": "L", "Ll": "L", "Lt": "L", "Lm": "L", "Lo": "L"}


class _CollapseTable(dict):
    """str.translate table: non-ASCII char -> its category stand-in."""

    def __missing__(self, cp: int) -> str:
        if cp < 0x80:
            v = chr(cp)
        elif cp in _WHITESPACE:
            v = "\x0b"
        else:
            v = _CAT_CHAR.get(unicodedata.category(chr(cp))[0], _C_OTHER)
        self[cp] = v
        return v


class _WsTable(dict):
    """str.translate table for the std::wregex path: non-ASCII whitespace -> \\v."""

    def __missing__(self, cp: int) -> str:
        v = "\x0b" if cp >= 0x80 and cp in _WHITESPACE else chr(cp)
        self[cp] = v
        return v


_COLLAPSE = _CollapseTable()
_WSMAP = _WsTable()

_UCAT_RE = re.compile(r"\\p\{(Lu|Ll|Lt|Lm|Lo|N|L|P|M|S)\}")


def _translate_regex(expr: str) -> tuple[re.Pattern, bool]:
    """llama.cpp's regex -> (compiled Python pattern, uses collapsed text)."""
    collapsed = _UCAT_RE.search(expr) is not None
    if collapsed:
        if any(ord(c) >= 0x80 for c in expr):
            raise TokenizerError("pre-tokenizer regex mixes unicode categories and non-ASCII characters")
        out = []
        inside = False
        i = 0
        while i < len(expr):
            c = expr[i]
            if c == "[" and (i == 0 or expr[i - 1] != "\\"):
                out.append("[")
                inside = True
                i += 1
                continue
            if inside and c == "]" and expr[i - 1] != "\\":
                out.append("]")
                inside = False
                i += 1
                continue
            m = _UCAT_RE.match(expr, i)
            if m:
                cls = _UCAT_CLASS[_UCAT_NAMES[m.group(1)]]
                out.append(cls if inside else "[" + cls + "]")
                i = m.end()
                continue
            out.append(c)
            i += 1
        expr = "".join(out)
    # ECMAScript '$' (no multiline) is the end of the input only
    if expr.endswith("$") and not expr.endswith("\\$"):
        expr = expr[:-1] + r"\Z"
    return re.compile(expr, re.ASCII), collapsed


# the pre-tokenizer regexes of llama.cpp's llm_tokenizer_bpe, by pre type
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK_RE = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# DeepSeek LLM's letter class, with escapes for characters that Unicode
# normalisation would change (U+1FBE, U+1FD3, U+1FDB, U+1F7D, U+2126, U+212A)
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_TEKKEN_RE = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
              r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
              r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_RE = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
             r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PORO_RE = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

_PRE_REGEXES: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", "[0-9][0-9][0-9]"],
    "gpt2": [_GPT2_RE],
    "llama3": [_LLAMA3_RE],
    "qwen2": [_QWEN2_RE],
    "qwen35": [_QWEN35_RE],
    "deepseek-llm": ["[\r\n]", "\\s?[" + _DEEPSEEK_LETTERS + "]+",
                     "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                     "\\s+$", _CJK_RE, r"\p{N}+"],
    "deepseek-coder": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_RE, r"\p{N}"],
    "deepseek-v3": [r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
                    "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_RE, "[0-9][0-9][0-9]"],
    "starcoder": [r"\p{N}", _GPT2_RE],
    "poro": [_PORO_RE],
    "viking": [_PORO_RE, r"\p{N}"],
    "tekken": [_TEKKEN_RE],
    "gpt4o": [_GPT4O_RE],
    "seed-coder": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "bailingmoe": [r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"],
    "superbpe": [r"\p{N}+", r"(?=(\d{3})+(?!\d))"],
}

# tokenizer.ggml.pre -> (regex set, flags) as in llama_vocab::impl::load
_PRE_TYPES: dict[str, tuple[str, dict[str, bool]]] = {}


def _reg(names: Iterable[str], rx: str, **flags: bool) -> None:
    for n in names:
        _PRE_TYPES[n] = (rx, flags)


_reg(["default"], "default")
_reg(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "jina-v5-nano"], "llama3", ignore_merges=True, add_bos=True)
_reg(["dbrx", "smaug-bpe"], "llama3")
_reg(["glm4", "chatglm-bpe"], "llama3", no_bos=True)
_reg(["deepseek-llm"], "deepseek-llm")
_reg(["deepseek-coder"], "deepseek-coder")
_reg(["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], "deepseek-v3")
_reg(["falcon"], "falcon")
_reg(["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
      "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt", "olmo",
      "jais", "trillion", "granite-docling"], "gpt2")
_reg(["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"],
     "starcoder")
_reg(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open",
      "grok-2"], "qwen2")
_reg(["qwen35"], "qwen35")
_reg(["poro-chat", "bloom", "gpt3-finnish"], "poro")
_reg(["viking"], "viking")
_reg(["tekken"], "tekken", ignore_merges=True, add_bos=True)
_reg(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], "gpt4o")
_reg(["seed-coder"], "seed-coder")
_reg(["bailingmoe", "bailingmoe2", "llada-moe"], "bailingmoe")
_reg(["superbpe"], "superbpe")

_COMPILED: dict[str, list[tuple[re.Pattern, bool]]] = {}


def _compiled(rx_name: str) -> list[tuple[re.Pattern, bool]]:
    c = _COMPILED.get(rx_name)
    if c is None:
        c = _COMPILED[rx_name] = [_translate_regex(e) for e in _PRE_REGEXES[rx_name]]
    return c


def bpe_pre_split(text: str, pre: str = "gpt-2") -> list[str]:
    """The words llama.cpp's pre-tokenizer ``pre`` splits text into."""
    if pre not in _PRE_TYPES:
        raise TokenizerError(f"unknown pre-tokenizer type {pre!r}")
    return _regex_split(text, _compiled(_PRE_TYPES[pre][0]))


def _regex_split(text: str, regexes: list[tuple[re.Pattern, bool]]) -> list[str]:
    """llama.cpp unicode_regex_split (without the byte encoding): every regex
    splits each current piece into its matches and the gaps between them."""
    if not text:
        return []
    ascii_text = text.isascii()
    collapsed = text if ascii_text else None
    wide = text if ascii_text else None
    lengths = [len(text)]
    for rx, use_collapsed in regexes:
        if use_collapsed:
            if collapsed is None:
                collapsed = text.translate(_COLLAPSE)
            src = collapsed
        else:
            if wide is None:
                wide = text.translate(_WSMAP)
            src = wide
        out: list[int] = []
        start = 0
        for ln in lengths:
            piece = src[start:start + ln]
            prev = 0
            for m in rx.finditer(piece):
                s, e = m.span()
                if s > prev:
                    out.append(s - prev)
                if e > s:
                    out.append(e - s)
                prev = e
            if prev < ln:
                out.append(ln - prev)
            start += ln
        lengths = out
    words = []
    start = 0
    for ln in lengths:
        words.append(text[start:start + ln])
        start += ln
    return words


# --------------------------------------------------------------------------
# the tokenizer


class GGUFTokenizer(ChatTemplateMixin):
    """A GGUF vocabulary (SPM or byte-level BPE) with llama.cpp's tokenizer."""

    def __init__(self, meta: dict[str, Any], path: str | None = None, name: str | None = None) -> None:
        self.path: str | None = path
        self.name = name or (Path(path).name if path else "<gguf>")
        nm = self.name

        def s(key: str, default: str | None = None) -> str | None:
            v = meta.get(key)
            if v is None:
                return default
            if isinstance(v, (bytes, bytearray, memoryview)):
                return bytes(v).decode("utf-8", errors="replace")
            return str(v)

        def flag(key: str, default: bool) -> bool:
            v = meta.get(key)
            return default if v is None else bool(v)

        model = s("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError(f"{nm}: no tokenizer.ggml.model in the metadata")
        tokens_raw = meta.get("tokenizer.ggml.tokens")
        if tokens_raw is None or len(tokens_raw) == 0:
            raise TokenizerError(f"{nm}: no tokenizer.ggml.tokens in the metadata")
        n = len(tokens_raw)
        self.model = model
        self.pre = s("tokenizer.ggml.pre", "") or ""
        self.model_chat_template = s("tokenizer.chat_template")

        # defaults per model type (llama_vocab::impl::load)
        add_space_prefix = False
        add_bos = False
        add_eos = False
        self.ignore_merges = False
        if model == "llama":
            self.kind = "spm"
            bos, eos, unk = 1, 2, 0
            add_space_prefix = True
            add_bos = True
            self.pre_regex: list[tuple[re.Pattern, bool]] | None = None
        elif model == "gpt2":
            self.kind = "bpe"
            bos, eos, unk = 11, 11, -1
            pre = self.pre or "default"
            if pre not in _PRE_TYPES:
                raise TokenizerError(f"{nm}: unsupported pre-tokenizer type {pre!r} (tokenizer.ggml.pre)")
            rx_name, pflags = _PRE_TYPES[pre]
            self.pre_regex = _compiled(rx_name)
            self.ignore_merges = pflags.get("ignore_merges", False)
            add_bos = pflags.get("add_bos", False)
            if pflags.get("no_bos"):
                bos = -1
        else:
            raise TokenizerError(f"{nm}: unsupported tokenizer model {model!r} (only 'llama' and 'gpt2')")
        self.add_space_prefix = flag("tokenizer.ggml.add_space_prefix", add_space_prefix)

        # pieces: one UTF-8 blob, no Python object per piece (Gemma has 262144);
        # matched as bytes, so a piece of invalid UTF-8 never matches text
        pieces = tokens_raw if isinstance(tokens_raw, StringArray) else StringArray.from_list(tokens_raw)
        empty = np.flatnonzero(pieces.lengths() == 0).tolist()
        if empty:
            fill = list(pieces)
            for i in empty:
                fill[i] = f"[EMPTY_{i}]".encode()
            pieces = StringArray.from_list(fill)
        self._pieces = pieces
        self.tokens: Sequence[str] = _Pieces(pieces)
        self.vocab_size = n
        # piece bytes -> id; duplicates: lowest id (llama.cpp refuses such files)
        self._tid = tid = pieces.index()

        def tget(text: str) -> int | None:
            return tid.get(text.encode())

        sc = meta.get("tokenizer.ggml.scores")
        if sc is not None and len(sc) < n:
            raise TokenizerError(f"{nm}: {len(sc)} scores for {n} tokens")
        self.scores = array("f", np.asarray(sc[:n], dtype=np.float32).tobytes() if sc is not None
                            else bytes(4 * n))
        tt = meta.get("tokenizer.ggml.token_type")
        if tt is not None:
            if len(tt) < n:
                raise TokenizerError(f"{nm}: {len(tt)} token types for {n} tokens")
            tt = np.asarray(tt[:n], dtype=np.int64)
            attrs = np.where((tt >= 0) & (tt < 7), _TYPE_TO_ATTR[np.clip(tt, 0, 6)], 0)
        else:
            attrs = np.full(n, A_NORMAL, dtype=np.int64)

        # special ids from the metadata (out-of-range ids keep the default)
        def sid(key: str, default: int) -> int:
            if default >= n:
                default = -1
            v = meta.get(key)
            if v is None:
                return default
            v = int(v)
            return v if 0 <= v < n else default

        self.bos_id = sid("tokenizer.ggml.bos_token_id", bos)
        self.eos_id = sid("tokenizer.ggml.eos_token_id", eos)
        self.unk_id = sid("tokenizer.ggml.unknown_token_id", unk)
        self.pad_id = sid("tokenizer.ggml.padding_token_id", -1)
        eot = sid("tokenizer.ggml.eot_token_id", -1)
        eom = sid("tokenizer.ggml.eom_token_id", -1)
        fim_pad = sid("tokenizer.ggml.fim_pad_token_id", -1)
        fim_rep = sid("tokenizer.ggml.fim_rep_token_id", -1)
        fim_sep = sid("tokenizer.ggml.fim_sep_token_id", -1)
        self.add_bos = flag("tokenizer.ggml.add_bos_token", add_bos)
        self.add_eos = flag("tokenizer.ggml.add_eos_token", add_eos)
        if self.add_bos and self.bos_id < 0:
            raise TokenizerError(f"{nm}: add_bos_token is true but there is no BOS token")

        # end-of-generation tokens, found by text as llama.cpp does; a token
        # found by its text is marked as control (llama.cpp does that too)
        by_text: set[int] = set()

        def find(texts: tuple[str, ...]) -> int:
            for t in texts:
                i = tget(t)
                if i is not None:
                    by_text.add(i)
                    return i
            return -1

        if eot < 0:
            eot = find(_EOT_TEXTS)
        if eom < 0:
            eom = find(("<|eom_id|>",))
        if fim_pad < 0:
            fim_pad = find(_FIM_PAD_TEXTS)
        if fim_rep < 0:
            fim_rep = find(_FIM_REP_TEXTS)
        if fim_sep < 0:
            fim_sep = find(_FIM_SEP_TEXTS)
        self.eot_id, self.eom_id = eot, eom
        eog: set[int] = {i for i in (fim_pad, fim_rep, fim_sep, eot, eom, self.eos_id) if i >= 0}
        for t in _EOG_TEXTS:
            i = tget(t)
            if i is None:
                continue
            eog.add(i)
            by_text.add(i)
        for i in by_text:
            attrs[i] |= A_CONTROL
        end = tget("<|end|>")
        has = {t: tget(t) is not None for t in ("<|return|>", "<|call|>", "<|calls|>", "<|flush|>")}
        if end is not None and end in eog and (
                (has["<|return|>"] and has["<|call|>"]) or (has["<|calls|>"] and has["<|flush|>"])):
            eog.discard(end)  # llama.cpp's harmony / solar-open workaround
            attrs[end] = A_USER_DEFINED
        self.stop_ids: tuple[int, ...] = tuple(sorted(eog))
        for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
            i = tget(t)
            if i is not None:
                attrs[i] = A_USER_DEFINED

        # per-model lstrip/rstrip attributes (llama.cpp sets them by name)
        gname = (s("general.name", "") or "").lower()
        arch = s("general.architecture", "") or ""
        special_ids = np.nonzero(attrs & _SPECIAL_ATTRS)[0]
        if (any(x in self.pre for x in ("jina-v2-de", "jina-v2-es", "jina-v2-code"))
                or any(x in arch for x in ("nomic-bert-moe", "jina-bert-v3"))):
            i = tget("<mask>")
            if i is not None:
                attrs[i] |= A_LSTRIP
        elif "phi-3" in gname or "phi3" in gname:
            attrs[special_ids] |= A_RSTRIP
            i = tget("</s>")
            if i is not None:
                attrs[i] |= A_RSTRIP
            for t in ("<unk>", "<s>", "<|endoftext|>"):
                i = tget(t)
                if i is not None:
                    attrs[i] &= ~A_RSTRIP
        self.attrs = array("H", attrs.astype(np.uint16).tobytes())

        # special tokens, longest first (ties: lower id first), grouped by first char
        self._special_text = {i: self.tokens[i] for i in special_ids.tolist()}
        order = sorted(self._special_text, key=lambda i: (-len(self._special_text[i]), i))
        self._special_rank = {i: r for r, i in enumerate(order)}
        self._special_by_char: dict[str, list[int]] = {}
        for i in order:
            self._special_by_char.setdefault(self._special_text[i][0], []).append(i)

        # byte fallback
        if self.kind == "spm":
            fb = []
            for b in range(256):
                i = tget(f"<0x{b:02X}>")
                if i is None:
                    i = tget(chr(b)) if b < 0x80 else None
                fb.append(-1 if i is None else i)
            self._byte_ids = fb
        else:
            merges = meta.get("tokenizer.ggml.merges")
            if merges is None:
                raise TokenizerError(f"{nm}: a gpt2 vocabulary needs tokenizer.ggml.merges")
            # b"left right" -> rank (lowest wins). Symbols never hold a space
            # (the GPT-2 alphabet writes it as U+0120), so a pair's text is
            # the stored merge exactly when llama.cpp's split would give it
            self._ranks = (merges if isinstance(merges, StringArray) else StringArray.from_list(merges)).index()
            self._word_cache: dict[str, tuple[int, ...]] = {}
        self._piece_cache: dict[tuple[int, bool], bytes] = {}

    # ------------------------------------------------------------ loading

    _PREFIXES = ("tokenizer.", "general.name", "general.architecture")

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "GGUFTokenizer":
        """Read the vocabulary of a GGUF file (a model or a vocabulary-only file)."""
        from .arch import ModelError
        from .gguf import read_gguf

        p = Path(path)
        try:
            meta = read_gguf(p).meta
        except ModelError as e:
            raise TokenizerError(str(e)) from None
        return cls(meta, str(p.resolve()), p.name)

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], path: str | os.PathLike) -> "GGUFTokenizer":
        """From metadata already read (``frontends.gguf.read_gguf``)."""
        p = Path(path)
        return cls(meta, str(p.resolve()), p.name)

    # ------------------------------------------------------------ basics

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (f"GGUFTokenizer({self.name!r}, model={self.model!r}, pre={self.pre!r}, "
                f"vocab_size={self.vocab_size})")

    def _check_id(self, token: int) -> None:
        if not 0 <= token < self.vocab_size:
            raise TokenizerError(f"{self.name}: token id {token} out of range [0, {self.vocab_size})")

    def id_to_piece(self, token: int) -> str:
        """The token's text as stored in the vocabulary."""
        self._check_id(token)
        return self.tokens[token]

    def piece_to_id(self, piece: str) -> int | None:
        try:
            return self._tid.get(piece.encode("utf-8", "surrogateescape"))
        except UnicodeEncodeError:
            return None

    def chat_special_text(self, token_id: int) -> str:
        """A special token's text as chat templates get it (llama.cpp's
        token_to_piece with special=true); "" when the vocabulary has none."""
        return self.tokens[token_id] if 0 <= token_id < self.vocab_size else ""

    def is_special(self, token: int) -> bool:
        """Control, user-defined or unknown-type token (split out before tokenizing)."""
        self._check_id(token)
        return bool(self.attrs[token] & _SPECIAL_ATTRS)

    # ------------------------------------------------------------ encode

    def _partition(self, text: str, special: bool) -> list[str | int]:
        """llama.cpp tokenizer_st_partition: text fragments and special token ids."""
        cand: list[int] = []
        by_char = self._special_by_char
        for ch in set(text) & by_char.keys():
            for i in by_char[ch]:
                if special or not (self.attrs[i] & (A_CONTROL | A_UNKNOWN)):
                    if self._special_text[i] in text:
                        cand.append(i)
        if not cand:
            return [text]
        cand.sort(key=self._special_rank.__getitem__)
        frags: list[str | int] = [text]
        for i in cand:
            tok = self._special_text[i]
            attr = self.attrs[i]
            new: list[str | int] = []
            for f in frags:
                if not isinstance(f, str) or tok not in f:
                    new.append(f)
                    continue
                pos = 0
                while True:
                    j = f.find(tok, pos)
                    if j < 0:
                        break
                    left = f[pos:j]
                    if attr & A_LSTRIP:
                        left = _rstrip_c_space(left)
                    if left:
                        new.append(left)
                    new.append(i)
                    pos = j + len(tok)
                    if attr & A_RSTRIP:
                        while pos < len(f) and f[pos] in _C_SPACE:
                            pos += 1
                rest = f[pos:]
                if rest:
                    new.append(rest)
            frags = new
        return frags

    def encode(self, text: str | bytes, bos: bool = True, eos: bool | None = None,
               special: bool = False) -> list[int]:
        """Token ids for text, as llama.cpp's ``llama_tokenize``.

        ``bos=True`` is llama.cpp's ``add_special``: BOS is prepended only when
        the vocabulary asks for it (``tokenizer.ggml.add_bos_token``, default
        true for SPM and Llama 3, false for most BPE vocabularies). ``eos``:
        None appends EOS when ``bos`` is true and ``add_eos_token`` says so;
        True/False force it. ``special=True`` parses control tokens written in
        the text (llama.cpp's ``parse_special``); user-defined tokens are
        always matched.
        """
        text = self._text(text)
        return self._encode_frags(self._partition(text, special) if text else [], bos, eos)

    def encode_segments(self, segments: Sequence[tuple[str, bool]], bos: bool = True) -> list[int]:
        """Ids of one text given in pieces, each with control tokens recognised
        (``True``: text a chat template wrote) or not (``False``: a message's
        content, where ``<|im_end|>`` is plain text). Plain text is tokenized
        across piece boundaries as if whole, so the ids equal
        ``encode(whole, special=True)`` unless a ``False`` piece holds the text
        of a control token."""
        frags: list[str | int] = []
        for text, special in segments:
            text = self._text(text)
            for f in self._partition(text, special) if text else []:
                if isinstance(f, str) and frags and isinstance(frags[-1], str):
                    frags[-1] += f
                else:
                    frags.append(f)
        return self._encode_frags(frags, bos, None)

    def _text(self, text: str | bytes) -> str:
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", errors="replace")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(f"{self.name}: text is not encodable as UTF-8 at index {e.start} "
                                 f"({text[e.start]!r})") from None
        return text

    def _encode_frags(self, frags: list[str | int], bos: bool, eos: bool | None) -> list[int]:
        """BOS, the fragments (special ids as they are, text tokenized), EOS."""
        out: list[int] = []
        if bos and self.add_bos:
            out.append(self.bos_id)
        if self.kind == "spm":
            prev_special = True
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    f = " " + f
                self._spm(f.replace(" ", _SPACE_ESC), out)
                prev_special = False
        else:
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                else:
                    self._bpe(f, out)
        if eos is None:
            eos = bos and self.add_eos
        if eos:
            if self.eos_id < 0:
                raise TokenizerError(f"{self.name}: no EOS token")
            out.append(self.eos_id)
        return out

    def _spm(self, text: str, out: list[int]) -> None:
        """llm_tokenizer_spm_session::tokenize on one fragment (spaces escaped).

        Symbols are UTF-8 bytes, one character each to begin with."""
        tid = self._tid
        sym = _UTF8_CHARS.findall(text.encode("utf-8"))
        n = len(sym)
        if n == 0:
            return
        if n == 1:
            self._spm_emit(sym[0], out)
            return
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        scores = self.scores
        heap: list[tuple[float, int, int, int]] = []
        push = heapq.heappush
        for i in range(n - 1):
            pair = sym[i] + sym[i + 1]
            t = tid.get(pair)
            if t is not None:
                heap.append((-scores[t], i, i + 1, len(pair)))
        heapq.heapify(heap)
        pop = heapq.heappop
        while heap:
            _, left, right, size = pop(heap)
            ls, rs = sym[left], sym[right]
            # a merged-away symbol is b"", and a grown one changes the size
            if not ls or not rs or len(ls) + len(rs) != size:
                continue
            merged = ls + rs
            sym[left] = merged
            sym[right] = b""
            k = nxt[right]
            nxt[left] = k
            if k < n:
                prv[k] = left
            p = prv[left]
            if p >= 0:
                t = tid.get(sym[p] + merged)
                if t is not None:
                    push(heap, (-scores[t], p, left, len(sym[p]) + len(merged)))
            if k < n:
                t = tid.get(merged + sym[k])
                if t is not None:
                    push(heap, (-scores[t], left, k, len(merged) + len(sym[k])))
        i = 0
        while i < n:
            self._spm_emit(sym[i], out)
            i = nxt[i]

    def _spm_emit(self, piece: bytes, out: list[int]) -> None:
        t = self._tid.get(piece)
        if t is not None:
            out.append(t)
            return
        for b in piece:
            t = self._byte_ids[b]
            if t < 0:
                raise TokenizerError(f"{self.name}: no byte-fallback token for byte 0x{b:02X}")
            out.append(t)

    def _bpe(self, text: str, out: list[int]) -> None:
        """llm_tokenizer_bpe_session::tokenize on one fragment."""
        cache = self._word_cache
        for word in _regex_split(text, self.pre_regex):
            ids = cache.get(word)
            if ids is None:
                ids = self._bpe_word(word.encode("utf-8").decode("latin-1").translate(_BYTE_ENCODE_TABLE))
                if len(cache) > 50000:
                    cache.clear()
                cache[word] = ids
            out.extend(ids)

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        """One word in the GPT-2 alphabet; symbols are UTF-8 bytes."""
        tid = self._tid
        if not word:
            return ()
        wb = word.encode("utf-8")
        if self.ignore_merges:
            t = tid.get(wb)
            if t is not None:
                return (t,)
        sym = _UTF8_CHARS.findall(wb)
        n = len(sym)
        if n > 1:
            ranks = self._ranks
            nxt = list(range(1, n + 1))
            prv = list(range(-1, n - 1))
            heap: list[tuple[int, int, int, bytes]] = []
            for i in range(n - 1):
                r = ranks.get(sym[i] + b" " + sym[i + 1])
                if r is not None:
                    heap.append((r, i, i + 1, sym[i] + sym[i + 1]))
            heapq.heapify(heap)
            push, pop = heapq.heappush, heapq.heappop
            while heap:
                _, left, right, txt = pop(heap)
                ls, rs = sym[left], sym[right]
                if not ls or not rs or ls + rs != txt:
                    continue
                sym[left] = txt
                sym[right] = b""
                k = nxt[right]
                nxt[left] = k
                if k < n:
                    prv[k] = left
                p = prv[left]
                if p >= 0:
                    r = ranks.get(sym[p] + b" " + txt)
                    if r is not None:
                        push(heap, (r, p, left, sym[p] + txt))
                if k < n:
                    r = ranks.get(txt + b" " + sym[k])
                    if r is not None:
                        push(heap, (r, left, k, txt + sym[k]))
        ids: list[int] = []
        for s in sym:
            if not s:
                continue
            t = tid.get(s)
            if t is not None:
                ids.append(t)
            else:
                # llama.cpp looks up every byte of the piece's UTF-8 as a
                # one-byte token; only ASCII bytes can match, others vanish
                for b in s:
                    if b < 0x80:
                        t = tid.get(bytes((b,)))
                        if t is not None:
                            ids.append(t)
        return tuple(ids)

    # ------------------------------------------------------------ decode

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """llama_token_to_piece(token, lstrip=0, special) as bytes."""
        key = (token, special)
        c = self._piece_cache.get(key)
        if c is not None:
            return c
        self._check_id(token)
        attr = self.attrs[token]
        text = self.tokens[token]
        if attr & (A_UNKNOWN | A_CONTROL):
            piece = _raw(text) if special else b""
        elif attr & A_USER_DEFINED:
            piece = _raw(text)
        elif attr & A_NORMAL:
            if self.kind == "spm":
                piece = _raw(text.replace(_SPACE_ESC, " "))
            else:
                cb = _CHAR_TO_BYTE
                piece = b"".join(bytes([cb[ch]]) if ch in cb else _raw(ch) for ch in text)
        elif attr & A_BYTE:
            try:
                piece = bytes([int(text[3:5], 16)])
            except ValueError:
                piece = b""
        else:
            piece = b""
        self._piece_cache[key] = piece
        return piece

    def _strips_after(self, prev: int | None) -> bool:
        """Does a piece following prev lose one leading space (the prefix encode added)?"""
        if not self.add_space_prefix:
            return False
        if prev is None or prev < 0 or prev >= self.vocab_size:
            return True
        return prev == self.bos_id or bool(self.attrs[prev] & _SPECIAL_ATTRS)

    def decode_piece(self, prev_token: int | None, token: int, special: bool = False) -> bytes:
        """Bytes for token following prev_token (None or -1: the start)."""
        piece = self.token_to_piece(int(token), special)
        if piece[:1] == b" " and self._strips_after(prev_token):
            piece = piece[1:]
        return piece

    def decode_bytes(self, ids: Iterable[int], special: bool = False) -> bytes:
        out = bytearray()
        prev: int | None = None
        for t in ids:
            t = int(t)
            out += self.decode_piece(prev, t, special)
            prev = t
        return bytes(out)

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Text for ids; invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD.

        Control tokens (BOS, EOS, <end_of_turn>, ...) give no text unless
        ``special=True``.
        """
        return self.decode_bytes(ids, special).decode("utf-8", errors="replace")

    def stream_decoder(self, special: bool = False) -> "GGUFStreamDecoder":
        return GGUFStreamDecoder(self, special)

    decode_stream = stream_decoder


class _Pieces(Sequence):
    """The vocabulary's pieces as str, decoded on access from the blob
    (invalid UTF-8 kept with surrogateescape)."""

    __slots__ = ("_strings",)

    def __init__(self, strings: StringArray) -> None:
        self._strings = strings

    def __len__(self) -> int:
        return len(self._strings)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._strings[i].decode("utf-8", errors="surrogateescape")

    def __iter__(self):
        for b in self._strings:
            yield b.decode("utf-8", errors="surrogateescape")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Pieces):
            return self._strings == other._strings
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


class GGUFStreamDecoder:
    """Incremental decoding: feed() returns only complete UTF-8 characters."""

    def __init__(self, tokenizer: GGUFTokenizer, special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.special = special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, prev_token: int | None, token: int) -> str:
        """Text completed by token (which follows prev_token; None or -1 at the start)."""
        return self._dec.decode(self.tokenizer.decode_piece(prev_token, token, self.special))

    def flush(self) -> str:
        """Whatever is pending at the end (an incomplete character gives U+FFFD)."""
        return self._dec.decode(b"", final=True)


# C isspace (llama.cpp's lstrip/rstrip use it byte-wise)
_C_SPACE = frozenset(" \t\n\v\f\r")


def _rstrip_c_space(s: str) -> str:
    i = len(s)
    while i > 0 and s[i - 1] in _C_SPACE:
        i -= 1
    return s[:i]


def _raw(text: str) -> bytes:
    return text.encode("utf-8", errors="surrogateescape")
