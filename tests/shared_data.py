"""Where the ../shared data is: the ../shared folder beside the checkout, when present."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
MODELS = SHARED / "models"
REFERENCE = SHARED / "reference"

needs_shared = pytest.mark.skipif(not MODELS.is_dir(), reason="../shared (models and references) is absent")


def reference_cases(name: str) -> list[dict]:
    if not (REFERENCE / name).exists():
        return []
    return json.loads((REFERENCE / name).read_text())["cases"]
