"""The error every layer of the runtime raises for a request it cannot
serve: the command line prints it as one line (exit 2), the Python API lets
it through as it is."""
from __future__ import annotations


class RunError(ValueError):
    """A request the model cannot serve (prompt too long, bad token id ...)."""


class ConstraintError(ValueError):
    """A constraint that cannot be enforced as given (the message says why).
    Here rather than in ``runtime.grammar`` so that code catching it need not
    import llguidance (a run without a grammar never does)."""
