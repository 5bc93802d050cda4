"""A tensor dimension: a size, or the name of one fixed at run time (``T``,
the rows of a prompt chunk). Apart from ``ir.types`` so that the quant
layouts, which ``ir.types`` asks for byte sizes, can name it too."""
from __future__ import annotations

from typing import Union

Dim = Union[int, str]
