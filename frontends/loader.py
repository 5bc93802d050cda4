"""Open any supported model file: find its format, config, weights, tokenizer."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .arch import ModelConfig, ModelError, WeightInfo


@dataclass
class LoadedModel:
    """A model as the compiler sees it: no weights read, only referenced."""

    path: str
    format: str          # "llama2c-v0", "llama2c-v2", ...
    config: ModelConfig
    weights: dict[str, WeightInfo]
    tokenizer: Any       # has encode(text, bos) / decode(ids) / vocab_size
    #: what key writes subtract in a low-bit KV cache, float32 [n_layers, kv_dim]
    #: (``runtime.key_offsets`` calibrates them); None: nothing
    key_offsets: Any = None

    @property
    def name(self) -> str:
        return os.path.splitext(os.path.basename(self.path))[0]


def find_llama2c_tokenizer(model_path: str, vocab_size: int) -> str:
    """run.c wants -z; as a convenience look beside the model for tok{V}.bin,
    then tokenizer.bin."""
    folder = os.path.dirname(os.path.abspath(model_path))
    for cand in (f"tok{vocab_size}.bin", "tokenizer.bin"):
        p = os.path.join(folder, cand)
        if os.path.exists(p):
            return p
    raise ModelError(f"{model_path}: no tokenizer found beside it (tok{vocab_size}.bin or tokenizer.bin); "
                     "pass one with -z")


def load_model(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None) -> LoadedModel:
    """Detect the format of ``path`` and read its header/metadata (not weights)."""
    from .llama2c import load_llama2c
    from .llama2c_tokenizer import Llama2cTokenizer

    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelError(f"{path}: no such file")
    if os.path.isdir(path):
        raise ModelError(f"{path}: is a directory, not a model file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _load_gguf(path, tokenizer)
    if magic == b"QSF1":
        return _load_qsf(path, tokenizer)
    ckpt = load_llama2c(path)
    cfg = ckpt.config
    tok_path = os.fspath(tokenizer) if tokenizer is not None else find_llama2c_tokenizer(path, cfg.vocab_size)
    tok = Llama2cTokenizer.from_file(tok_path, cfg.vocab_size)
    return LoadedModel(path, f"llama2c-v{ckpt.version}", cfg, ckpt.weights, tok)


def _load_gguf(path: str, tokenizer: str | os.PathLike | None) -> LoadedModel:
    from .gguf import load_gguf
    from .gguf_tokenizer import GGUFTokenizer

    m = load_gguf(path)
    if tokenizer is not None:
        raise ModelError(f"{path}: a GGUF model carries its own vocabulary; -z is for llama2.c checkpoints")
    tok = GGUFTokenizer.from_metadata(m.metadata, path)
    if tok.vocab_size != m.config.vocab_size:
        raise ModelError(f"{path}: the vocabulary has {tok.vocab_size} tokens, the embedding "
                         f"{m.config.vocab_size} rows")
    m.config.stop_ids = tuple(sorted(set(m.config.stop_ids) | set(getattr(tok, "stop_ids", ()))))
    return LoadedModel(path, "gguf", m.config, m.weights, tok)


def _load_qsf(path: str, tokenizer: str | os.PathLike | None) -> LoadedModel:
    from .qsf import load_qsf

    if tokenizer is not None:
        raise ModelError(f"{path}: a QSF model carries its own tokenizer; -z is for llama2.c checkpoints")
    m = load_qsf(path)
    return LoadedModel(path, "qsf", m.config, m.weights, m.tokenizer)


def load_tokenizer(path: str | os.PathLike, vocab_size: int | None = None) -> Any:
    """A tokenizer on its own, from any file that holds one: a llama2.c
    ``tokenizer.bin``, a GGUF model or vocabulary-only GGUF, or a QSF model.
    ``vocab_size`` (llama2.c only) is the checkpoint's: that file does not say."""
    from .llama2c_tokenizer import Llama2cTokenizer, TokenizerError

    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read: {e.strerror}") from None
    if magic == b"GGUF":
        from .gguf_tokenizer import GGUFTokenizer

        return GGUFTokenizer.from_file(path)
    if magic == b"QSF1":
        from .qsf import open_qsf, read_tokenizer

        qf = open_qsf(path)
        return read_tokenizer(qf, qf.header.vocab_size)
    return Llama2cTokenizer.from_file(path, vocab_size)
