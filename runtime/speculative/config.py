"""What speculative decoding is asked to do: which drafter, how many tokens."""
from __future__ import annotations

from dataclasses import dataclass

#: tokens drafted per verify step at most, unless --draft-max says otherwise
DEFAULT_DRAFT_MAX = 8
#: --draft-max limit: a verify step must fit one prefill chunk with room to spare
MAX_DRAFT_MAX = 64


class SpeculationError(ValueError):
    """A speculation setting that cannot work (other vocabulary, too many layers ...)."""


@dataclass
class Speculation:
    """Which drafter, and how many tokens it may propose per step.
    Exactly one of ``lookup`` (n-gram length), ``draft`` (a model file or a
    loaded ``Model``) and ``draft_layers`` (K) is set."""

    lookup: int = 0
    draft: object = None
    draft_layers: int = 0
    draft_max: int = DEFAULT_DRAFT_MAX
    #: with ``draft``: its tokenizer file (llama2.c models), else None
    draft_tokenizer: str | None = None

    def validate(self) -> None:
        chosen = [n for n, on in (("--lookup", self.lookup), ("--draft", self.draft is not None),
                                  ("--draft-layers", self.draft_layers)) if on]
        if len(chosen) != 1:
            raise SpeculationError("speculative decoding takes one drafter: --lookup N, --draft MODEL or "
                                   f"--draft-layers K (got {', '.join(chosen) or 'none'})")
        if self.lookup < 0 or self.draft_layers < 0:
            raise SpeculationError("--lookup and --draft-layers take a positive number")
        if not 1 <= self.draft_max <= MAX_DRAFT_MAX:
            raise SpeculationError(f"--draft-max {self.draft_max}: must be between 1 and {MAX_DRAFT_MAX}")

    @property
    def kind(self) -> str:
        return "lookup" if self.lookup else "draft" if self.draft is not None else "draft-layers"
