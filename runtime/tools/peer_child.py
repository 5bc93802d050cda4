"""A peer engine run in a child process, as ``lmc bench`` measures it beside
us (its threads must not share our process): the child prints one line
``@@<json>``; anything else is an error, said in one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_peer(script: str, name: str, package: tuple[str, str], model_path: str, *args: int | str) -> Any:
    """The child's JSON, or ``{"error": ...}``: the peer's package
    (``(module, pip name)``) is not installed, or the child's stderr's last
    line that names an error (else its last line)."""
    import importlib.util

    module, pip_name = package
    if importlib.util.find_spec(module) is None:
        return {"error": f"{pip_name} is not installed (pip install {pip_name})"}
    cmd = [sys.executable, "-c", script, os.path.abspath(model_path), *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("@@")), None)
    if r.returncode != 0 or line is None:
        lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if "rror" in ln), lines[-1] if lines else "no output")
        return {"error": f"{name} did not run this file: {why[:240]}"}
    return json.loads(line[2:])
