"""Turn ``lmc ir`` pictures (DOT text from ``ir.dot``) into SVG or PNG.

Rendering needs Graphviz's ``dot`` program, which is a system package, not a
Python one, so its absence is a user error with the install command, not a
traceback. Everything is rendered in memory and written in one rename, so a
failed render leaves no half-written file behind.
"""
from __future__ import annotations

import os
import shutil
import subprocess

from ..errors import RunError

#: formats that need Graphviz; text and dot are written as they are
RENDERED = ("svg", "png")


def render(dot: str, fmt: str) -> bytes:
    """The picture in ``fmt`` (svg, png). Raises RunError without Graphviz."""
    if fmt not in RENDERED:
        raise ValueError(f"cannot render format {fmt!r} (one of {', '.join(RENDERED)})")
    if shutil.which("dot") is None:
        raise RunError(f"--format {fmt} needs Graphviz's `dot` program, which is not installed: "
                       "install Debian's graphviz package (apt-get install graphviz), or use --format dot")
    try:
        import graphviz
    except ImportError:
        raise RunError(f"--format {fmt} needs the graphviz Python package: pip install graphviz") from None
    try:
        return graphviz.Source(dot).pipe(format=fmt)
    except (graphviz.ExecutableNotFound, subprocess.CalledProcessError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RunError(f"Graphviz failed to draw the graph: {first}") from None


def write_atomic(path: str, data: bytes) -> None:
    """All of ``data`` or nothing: a temporary file beside ``path``, renamed over it."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
