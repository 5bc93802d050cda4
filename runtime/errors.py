"""The error every layer of the runtime raises for a request it cannot
serve: the command line prints it as one line (exit 2), the Python API lets
it through as it is."""
from __future__ import annotations


class RunError(ValueError):
    """A request the model cannot serve (prompt too long, bad token id ...)."""
