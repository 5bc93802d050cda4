"""Sliding-window perplexity of a text under a model (``lmc perplexity``).

The method is llama.cpp's and Hugging Face's strided perplexity, so numbers
can be compared with theirs:

- the whole text is tokenized once, with BOS first;
- window k covers tokens ``[k*stride, k*stride + ctx)`` (the last one is
  cut at the end of the text), and its logits come from one
  ``Model.logits`` call, i.e. one all-logits prefill from position 0;
- as llama.cpp does, the first token of every window is replaced by BOS
  (window 0 already starts with it; a vocabulary without BOS leaves the
  windows as they are), so each window is a well-formed
  sequence the model was trained on; the replaced token is only context,
  never a target, in that window;
- a window scores only the targets no earlier window scored, so with
  ``stride < ctx`` every token after the first is scored exactly once (the
  later windows' targets see at least ``ctx - stride`` tokens of context).
  With ``stride == ctx`` the windows do not overlap and the token at each
  window boundary, replaced by BOS, goes unscored (as in llama.cpp's
  chunks); ``tokens`` in the result says how many were scored.

Log-softmax is taken in float64 from the float32 logits, a block of rows
at a time, so a 262144-token vocabulary does not need a float64 copy of a
whole window.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Protocol, Sequence

import numpy as np

from .errors import RunError

#: float64 elements per block of log-softmax rows (128 MiB)
_BLOCK_ELEMS = 1 << 24


class ScoringModel(Protocol):
    """What perplexity needs from a model: ``runtime.Model`` has it, for
    every file format ``runtime.load`` reads."""

    ctx: int

    def encode(self, text: str, bos: bool = True) -> list[int]: ...

    def logits(self, ids: Sequence[int]) -> np.ndarray: ...


@dataclass(frozen=True)
class Window:
    """Tokens ``[start, end)`` go through the model; targets ``[first, end)`` are scored."""

    start: int
    end: int
    first: int


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float               # mean negative log-likelihood of the scored tokens, nats
    tokens: int              # tokens scored
    text_tokens: int         # tokens of the text, BOS included
    evaluated_tokens: int    # tokens run through the model, all windows
    windows: int
    ctx: int
    stride: int
    seconds: float           # the windows' forward passes and scoring; not loading or compiling

    @property
    def tokens_per_s(self) -> float:
        """Scored tokens per second."""
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["seconds"] = round(self.seconds, 4)
        d["tokens_per_s"] = round(self.tokens_per_s, 2)
        return d

    def format_text(self, label: str = "") -> str:
        """One readable block, ``key: value`` aligned."""
        rows = [("perplexity", f"{self.perplexity:.4f}"),
                ("mean NLL", f"{self.nll:.6f} nats/token"),
                ("tokens scored", f"{self.tokens} of {self.text_tokens} (BOS included)"),
                ("windows", f"{self.windows} (ctx {self.ctx}, stride {self.stride}; "
                            f"{self.evaluated_tokens} tokens evaluated)"),
                ("time", f"{self.seconds:.3f} s, {self.tokens_per_s:.1f} tokens/s")]
        w = max(len(k) for k, _ in rows)
        head = [label] if label else []
        return "\n".join(head + [f"{k.rjust(w)}: {v}" for k, v in rows]) + "\n"


def plan_windows(n_tokens: int, ctx: int, stride: int) -> list[Window]:
    """The windows over ``n_tokens`` tokens (see the module docstring)."""
    check_window_args(n_tokens, ctx, stride)
    out: list[Window] = []
    scored_until = 1  # token 0 (BOS) has nothing before it
    start = 0
    while True:
        end = min(start + ctx, n_tokens)
        out.append(Window(start, end, max(start + 1, scored_until)))
        scored_until = end
        if end == n_tokens:
            return out
        start += stride


def check_window_args(n_tokens: int, ctx: int, stride: int) -> None:
    if ctx < 2:
        raise RunError(f"-c/--ctx {ctx}: a window needs at least 2 tokens")
    if not 0 < stride <= ctx:
        raise RunError(f"--stride {stride}: must be between 1 and the window length (ctx {ctx})")
    if n_tokens < 2:
        raise RunError(f"the text is {n_tokens} token{'s' if n_tokens != 1 else ''} long (BOS included); "
                       "perplexity needs at least 2")


def token_nll(logits: np.ndarray, targets: Sequence[int]) -> np.ndarray:
    """-log softmax(logits[i])[targets[i]] per row, in float64."""
    targets = np.asarray(targets, dtype=np.int64)
    out = np.empty(len(targets), np.float64)
    block = max(1, _BLOCK_ELEMS // max(logits.shape[1], 1))
    for a in range(0, len(targets), block):
        x = np.array(logits[a:a + block], dtype=np.float64)
        picked = x[np.arange(len(x)), targets[a:a + block]]
        mx = x.max(axis=1, keepdims=True)
        x -= mx
        np.exp(x, out=x)
        out[a:a + block] = mx[:, 0] + np.log(x.sum(axis=1)) - picked
    return out


def perplexity_of_ids(model: ScoringModel, ids: Sequence[int], ctx: int | None = None,
                      stride: int | None = None, progress: bool = False, bos: int | None = -1) -> PerplexityResult:
    """Perplexity of a token sequence (BOS already first, as ``encode`` gives it).

    ``ctx`` defaults to the context the model was loaded with and may not
    exceed it; ``stride`` defaults to ``ctx // 2``. ``bos`` replaces each
    window's first token: by default ``ids[0]``; None for a vocabulary
    without BOS, whose windows then start mid-text (as in llama.cpp)."""
    ids = [int(i) for i in ids]
    ctx = model.ctx if ctx is None else ctx
    if ctx > model.ctx:
        raise RunError(f"-c/--ctx {ctx}: the model was loaded with a context of {model.ctx} tokens")
    if stride is None:
        stride = max(ctx // 2, 1)
    wins = plan_windows(len(ids), ctx, stride)
    if bos == -1:
        bos = ids[0]
    total = 0.0
    scored = evaluated = 0
    bar = _progress_bar(len(wins), len(ids) - 1) if progress else None
    t0 = time.perf_counter()
    try:
        for w in wins:
            window = ids[w.start:w.end]
            if bos is not None:
                window[0] = bos
            logits = model.logits(window)
            # logits row r predicts window token r + 1
            nll = token_nll(logits[w.first - 1 - w.start: w.end - 1 - w.start], ids[w.first:w.end])
            total += float(nll.sum())
            scored += len(nll)
            evaluated += len(window)
            if bar is not None:
                bar.set_postfix_str(f"ppl {math.exp(total / max(scored, 1)):.3f}", refresh=False)
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    mean = total / scored if scored else float("nan")
    return PerplexityResult(perplexity=math.exp(mean), nll=mean, tokens=scored, text_tokens=len(ids),
                            evaluated_tokens=evaluated, windows=len(wins), ctx=ctx, stride=stride, seconds=seconds)


def perplexity(model: ScoringModel, text: str, ctx: int | None = None, stride: int | None = None,
               progress: bool = False) -> PerplexityResult:
    """Perplexity of ``text``: tokenized once with BOS first, then scored in
    windows of ``ctx`` tokens every ``stride`` tokens. ``progress`` draws a
    bar on stderr."""
    if not text:
        raise RunError("the text is empty")
    head = model.encode("", bos=True)  # [BOS], or [] when the vocabulary adds none
    return perplexity_of_ids(model, model.encode(text, bos=True), ctx, stride, progress,
                             bos=head[0] if head else None)


def _progress_bar(windows: int, targets: int):
    """A bar on stderr, sized by shutil, which falls back to 80x24 on a
    terminal that reports 0x0 (tqdm would then draw nothing)."""
    import shutil

    from tqdm import tqdm

    cols, rows = shutil.get_terminal_size()
    return tqdm(total=windows, unit="window", desc=f"perplexity ({targets} targets)", file=sys.stderr,
                leave=False, ncols=cols, nrows=rows)
