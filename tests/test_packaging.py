"""A wheel (``pip install .``, not editable) carries the packages that
pyproject.toml lists and nothing else: every folder of the code with an
``__init__.py`` must be on that list, or the installed ``lmc`` fails to
import it (``runtime.serve`` was missing once, unseen by the editable
installs the tests use)."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _code_packages() -> set[str]:
    found = set()
    for top in ("ir", "frontends", "passes", "compiler", "runtime"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if "__init__.py" in filenames:
                found.add(os.path.relpath(dirpath, ROOT).replace(os.sep, "."))
    return found


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is in the standard library from Python 3.11")
def test_every_package_is_listed_in_pyproject() -> None:
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    assert _code_packages() == listed
