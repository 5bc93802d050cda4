"""Named passes, so the pipeline, ``--dump-after`` and ``lmc ir --after`` all
draw on the same list."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ir.graph import Graph


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Graph], Graph]
    doc: str


PASSES: dict[str, Pass] = {}


def register_pass(name: str) -> Callable[[Callable[[Graph], Graph]], Callable[[Graph], Graph]]:
    def deco(fn: Callable[[Graph], Graph]) -> Callable[[Graph], Graph]:
        PASSES[name] = Pass(name, fn, (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else "")
        return fn

    return deco
