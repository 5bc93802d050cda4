"""The Python API of one stream: a loaded, compiled model that encodes,
decodes, generates and scores text (``runtime.load`` makes one; the batch
engine's model is ``runtime.engine.load_batch_model``'s)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from compiler.artifact import Artifact
from compiler.driver import LoadedModel

from .context_shift import chat_keep, check_keep, shift_tokens
from .errors import ConstraintError, RunError
from .loading import DEFAULT_CTX, BuildOptions, build_executor, check_run_options, return_freed_memory
from .prefix import common_prefix
from .sampling import Sampler, SamplerConfig
from .speculative import (ONE_STREAM, DraftLength, Speculation, SpeculationError, StreamSeq, accept, draft_sampler,
                          grammar_checked)
from .speculative.build import build_drafter
from .stop_strings import TextAssembler

if TYPE_CHECKING:
    from .grammar import Constraint, GrammarMatcher

__all__ = ["DEFAULT_CTX", "Completion", "GenerationStats", "Model", "RunError", "TextStream"]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    sample_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        decode_steps = max(self.generated_tokens - 1, 0)
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "prefill_s": round(self.prefill_s, 6),
            "prefill_tok_s": round(self.prompt_tokens / self.prefill_s, 2) if self.prefill_s else None,
            "decode_s": round(self.decode_s, 6),
            "decode_tok_s": round(decode_steps / self.decode_s, 2) if self.decode_s else None,
            "sample_s": round(self.sample_s, 6),
            **self.extra,
        }


class Model:
    """A loaded, compiled model with its own KV cache."""

    #: a paged pool's options (what a drafter built beside it reads): None,
    #: one stream's cache is contiguous (batched serving: ``runtime.engine``)
    batch = None

    def __init__(self, loaded: LoadedModel, backend: str = "llvm", ctx: int | None = None,
                 threads: int | None = None, artifact: Artifact | None = None,
                 use_cache: bool = True, passes: tuple[str, ...] | None = None,
                 mem_budget: int | None = None, stream: str | None = None, kv_type: str | None = None,
                 stream_io: str = "pread", status: Callable[[str], None] | None = None,
                 speculation: Speculation | None = None, context_shift: bool | str = False,
                 keep: int | None = None, decode_first: bool = False) -> None:
        """``passes``: the compiler's pass list; None for the backend's default
        (``compiler.pipeline.default_pipeline``). ``mem_budget``: bytes of
        peak resident memory for the whole process (llvm backend): weights
        may stream from disk and the KV cache shrink to fit. ``kv_type``: KV
        cache storage, f16 (the default), f32 or q8; None lets a budget choose.
        ``status(text)`` is told of slow steps (a terminal's status line).
        ``speculation``: decode speculatively (``runtime.speculative``): a
        drafter proposes tokens and one ``verify`` step checks them.
        ``context_shift``: a generation (or a prompt) that would pass the
        context keeps its first ``keep`` tokens, drops the oldest half of
        the rest and goes on (``runtime.context_shift``); ``keep`` None:
        0 for ``generate``/``complete``, the system prompt's tokens for
        ``chat`` (``context_shift.chat_keep``). ``context_shift="rotate"``:
        a shift while generating moves the kept rows and turns their keys
        (``runtime.kv_rotate``, llama.cpp's way: cheap, not exact) where
        the cache allows, else recomputes. ``decode_first``: a cold start
        runs as soon as the decode step is compiled (a prompt as decode
        steps, the same bits) while the prompt chunk's kernels compile in
        the background (``runtime.loading.build_executor``)."""
        full_ctx = check_run_options(loaded, ctx, threads, kv_type)
        if speculation is not None:
            try:
                speculation.validate()
            except SpeculationError as e:
                raise RunError(str(e)) from None
        self.loaded = loaded
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        #: how its executors (and a drafter's) are built
        self.build = BuildOptions(backend, threads, use_cache, passes, status)
        built = build_executor(loaded, self.build, full_ctx, artifact=artifact, user_ctx=ctx is not None,
                               mem_budget=mem_budget, stream=stream, kv_type=kv_type, stream_io=stream_io,
                               verify=speculation is not None, decode_first=decode_first)
        if built.batch is not None:
            raise RunError(f"{loaded.path}: this compiled model was built for batched serving; load it with "
                           f"runtime.engine.load_batch_model")
        self.executor = built.executor
        self.ctx = built.ctx
        self.kv_type = built.kv_type
        self.kv_bytes = built.kv_bytes
        self.compile_info = built.compile_info
        self.backend = backend
        check_keep(keep, self.ctx)
        shift_by = "recompute" if context_shift is True else context_shift or None
        if shift_by not in (None, "recompute", "rotate"):
            raise RunError(f"context_shift={context_shift!r}: True, 'recompute' or 'rotate'")
        #: go on past the context (``runtime.context_shift``), keeping the first ``keep`` tokens
        self.context_shift = shift_by is not None
        self.shift_by = shift_by
        self._rotator = None   # a runtime.kv_rotate.KVRotator, or why there is none (made at the first shift)
        self.keep = keep
        self.last_stats = GenerationStats()
        self.last_completion: Completion | None = None
        self._kv: list[int] = []   # the ids whose K/V rows the cache holds, from position 0
        #: how generate decodes: speculatively with this drafter, or plainly (None)
        self.speculation: Speculation | None = None
        self.drafter = None
        if speculation is not None:
            self.drafter = build_drafter(self, speculation)
            self.speculation = speculation
        if mem_budget is not None:
            return_freed_memory()

    @property
    def compiling(self) -> bool:
        """Whether a ``decode_first`` start is still compiling the rest of
        its code (the prompt chunks') in the background."""
        return bool(getattr(self.executor, "building", False))

    def finish_compiling(self) -> None:
        """Wait for that compile, so that the next load of this model is
        warm (a command that ends early would otherwise drop it, keeping
        only the kernels done so far), and put the weights, mapped at once
        by the cold start, on large pages (``NativeExecutor.settle_weights``). Without the compile cache there is
        no next load to serve: the compile stops instead."""
        if not hasattr(self.executor, "wait_for_build"):   # the interpreter
            return
        if not self.build.use_cache:
            self.executor.stop_building()
            return
        self.executor.wait_for_build()
        self.executor.settle_weights()

    # --- text --------------------------------------------------------------
    def encode(self, text: str, bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of ``text``; ``special=True`` also recognises control
        tokens written in it (``<|im_start|>``), as llama.cpp's parse_special."""
        return self.tokenizer.encode(text, bos=bos, special=special)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    # --- numbers -------------------------------------------------------------
    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
        if bad:
            raise RunError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        if not ids:
            raise RunError("no tokens to run")
        if len(ids) > self.ctx:
            raise RunError(f"prompt of {len(ids)} tokens is longer than the context ({self.ctx})")
        return ids

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Next-token logits after each position: float32 [len(ids), vocab]."""
        ids = self._check_ids(ids)
        self._kv = []
        self.executor.reset()
        out = np.array(self.executor.prefill(ids, 0, all_logits=True), dtype=np.float32)
        self._kv = ids
        return out

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, repeat_penalty: float = 1.0,
                 seed: int | None = None, stop: bool = True, reuse_cache: bool = False,
                 grammar: "Constraint | None" = None, keep: int | None = None) -> Iterator[int]:
        """Yield new token ids. The prompt goes through one prefill pass; a
        sampled stop token is yielded and ends generation. Generation also
        ends when the context is full, whatever ``max_new_tokens`` says (as
        run.c clips its steps); ``last_completion.stop_reason`` then says
        ``length`` (``eos`` after a stop token). ``reuse_cache``: keep the KV
        rows of the longest prefix the cache already holds from the last
        call and prefill only the rest (a chat's earlier turns). ``grammar``:
        the output follows this constraint (``runtime.grammar``: a JSON
        schema, a Lark grammar, a regex); generation ends (``stop``) once
        it is complete and nothing more can follow. With ``context_shift``
        on, the context does not end generation: the first ``keep`` tokens
        (None: the model's ``keep``, else 0) stay, the oldest half of the
        rest goes (a prompt longer than the context is cut so too), and
        ``last_stats.extra`` counts ``context_shifts`` and ``shifted_tokens``."""
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        shift_keep, prompt_shift = None, 0
        if self.context_shift:
            shift_keep = keep if keep is not None else (self.keep or 0)
            check_keep(shift_keep, self.ctx, "keep")
            ids, prompt_shift = shift_tokens(ids, shift_keep, self.ctx)
        ids = self._check_ids(ids)
        if max_new_tokens < 0:
            raise RunError(f"-n {max_new_tokens}: must be >= 0")
        cfg = SamplerConfig(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            repeat_penalty=repeat_penalty, seed=seed)
        cfg.validate()
        sampler = Sampler(cfg, self.config.vocab_size, self._matcher(grammar))
        # positions P-1 .. ctx-1 each give one token: at most ctx - P + 1
        n = min(max_new_tokens, self.ctx - len(ids) + 1) if shift_keep is None else max_new_tokens
        comp = self.last_completion = Completion(prompt_ids=ids)
        self.last_stats = comp.stats
        if shift_keep is not None:
            comp.stats.extra.update(keep=shift_keep, context_shifts=int(prompt_shift > 0), shifted_tokens=prompt_shift)
        if self.drafter is not None and self.speculation is not None:
            seq = StreamSeq(list(ids), draft_sampler(cfg, self.config.vocab_size))
            return self._generate_speculative(seq, n, sampler, stop, reuse_cache, comp, shift_keep)
        return self._generate(ids, n, sampler, stop, reuse_cache, comp, shift_keep)

    def _matcher(self, grammar: "Constraint | None") -> "GrammarMatcher | None":
        if grammar is None:
            return None
        from .grammar import ConstraintError, GrammarMatcher

        try:
            return GrammarMatcher(grammar, self.tokenizer, tuple(self.config.stop_ids), self.config.vocab_size)
        except ConstraintError as e:
            raise RunError(str(e)) from None

    def _prefill(self, ids: list[int], reuse: bool) -> np.ndarray:
        """Logits after ``ids``, running only what the cache lacks when
        ``reuse`` (at least the last token, whose logits are needed)."""
        start = 0
        if reuse:
            start = self.executor.reusable(min(common_prefix(ids, self._kv), len(ids) - 1))
        if start == 0:
            self.executor.reset()
        self._kv = ids[:start]   # rows past start are overwritten from here on
        logits = self.executor.prefill(ids[start:], start)
        self._kv = list(ids)
        self.last_completion.cached_tokens = start
        return logits

    def _shift(self, history: list[int], keep: int, comp: "Completion") -> np.ndarray:
        """The context is full: ``history`` (what it holds and the pending
        token) loses the oldest half after its first ``keep`` tokens, in
        place, and the rows past ``keep`` are recomputed (one prefill, exact
        with every KV type); the logits after the pending token."""
        kept, dropped = shift_tokens(history, keep, self.ctx - 1)
        st = comp.stats
        st.extra["context_shifts"] += 1
        st.extra["shifted_tokens"] += dropped
        comp.shifted_ids = history
        if self.shift_by == "rotate" and self._kv == history[:-1] and self._rotate(keep, dropped, len(history) - 1,
                                                                                    st):
            history[:] = kept
            self._kv = kept[:-1]
            logits = self.executor.decode(kept[-1], len(kept) - 1)
            self._kv.append(kept[-1])
            return logits
        history[:] = kept
        cached = comp.cached_tokens   # the prompt's count, not the shift's
        logits = self._prefill(history, True)
        comp.cached_tokens = cached
        return logits

    def _rotate(self, keep: int, n: int, rows: int, st: GenerationStats) -> bool:
        """Shift the cache's rows by rotation (``runtime.kv_rotate``); False
        where it cannot (``last_stats.extra["shift_by"]`` says why)."""
        from .kv_rotate import KVRotator

        if self._rotator is None:
            self._rotator = KVRotator.of(self)
        if isinstance(self._rotator, str):
            st.extra["shift_by"] = f"recompute ({self._rotator})"
            return False
        self._rotator.shift(keep, n, rows)
        st.extra["shift_by"] = "rotate"
        return True

    def _generate(self, ids: list[int], n: int, sampler: Sampler, stop: bool, reuse: bool,
                  comp: "Completion", keep: int | None = None) -> Iterator[int]:
        st = comp.stats
        if n == 0:
            comp.stop_reason = "length"
            return
        streams = bool(getattr(self.executor, "stream", None))
        io0 = self.executor.stream_stats() if streams else None
        t0 = time.perf_counter()
        logits = self._prefill(ids, reuse)
        st.prefill_s = time.perf_counter() - t0
        st.extra["cached_tokens"] = comp.cached_tokens
        io1 = self.executor.stream_stats() if streams else None
        if streams:
            st.extra["prefill_io_wait_s"] = round(io1["io_wait_s"] - io0["io_wait_s"], 6)
        history = list(ids)
        pos = len(ids)
        stops = set(self.config.stop_ids) if stop else set()
        for i in range(n):
            t0 = time.perf_counter()
            tok = sampler.sample(logits, history)
            st.sample_s += time.perf_counter() - t0
            st.generated_tokens += 1
            history.append(tok)
            comp.generated_ids.append(tok)
            if tok in stops:
                comp.stop_reason = "eos"
            elif sampler.grammar is not None and sampler.grammar.done_at == i + 1:
                comp.stop_reason = "stop"    # the grammar is complete: nothing can follow
            elif i == n - 1:
                comp.stop_reason = "length"
            yield tok
            if comp.stop_reason is not None:
                return
            t0 = time.perf_counter()
            if pos >= self.ctx and keep is not None:   # full: shift and go on
                logits = self._shift(history, keep, comp)
                pos = len(history)
            else:
                logits = self.executor.decode(tok, pos)
                self._kv.append(tok)
                pos += 1
            st.decode_s += time.perf_counter() - t0
            if streams:  # the compute / I/O split of the decode steps so far
                io = self.executor.stream_stats()
                wait = io["io_wait_s"] - io1["io_wait_s"]
                st.extra.update(decode_io_wait_s=round(wait, 6), decode_compute_s=round(st.decode_s - wait, 6),
                                read_bytes=io["read_bytes"] - io0["read_bytes"],
                                read_s=round(io["read_s"] - io0["read_s"], 6))

    def _generate_speculative(self, seq: StreamSeq, n: int, sampler: Sampler, stop: bool, reuse: bool,
                              comp: "Completion", keep: int | None = None) -> Iterator[int]:
        """``_generate`` with a drafter: the first token comes from the
        prefill as plain decoding's does; then each step drafts up to
        ``draft_max`` tokens and runs the pending token and the drafts
        through ``verify`` in one step (a plain decode step when nothing
        was drafted), keeping the accepted drafts and the target's own next
        token; the cache's rows past them are stale and get overwritten.
        ``seq``: the stream as the drafter sees it (its tokens grow in place)."""
        st = comp.stats
        spec = self.speculation
        drafter = self.drafter
        ex = self.executor
        st.extra.update(speculative=spec.kind, draft_max=spec.draft_max, drafted=0, accepted=0, verify_steps=0,
                        draft_s=0.0)
        draft_s = 0.0
        if n == 0:
            comp.stop_reason = "length"
            return
        ids = list(seq.tokens)
        t0 = time.perf_counter()
        logits = self._prefill(ids, reuse)
        st.prefill_s = time.perf_counter() - t0
        st.extra["cached_tokens"] = comp.cached_tokens
        history = seq.tokens
        stops = set(self.config.stop_ids) if stop else set()
        length = DraftLength(spec.draft_max)
        limit = min(spec.draft_max, getattr(ex, "chunk", spec.draft_max + 1) - 1)
        t0 = time.perf_counter()
        tok = sampler.sample(logits, history)
        st.sample_s += time.perf_counter() - t0
        pending = [tok]   # tokens to yield, in order; the last one's K/V is not in the cache yet
        while True:
            for t in pending:
                st.generated_tokens += 1
                history.append(t)
                comp.generated_ids.append(t)
                if t in stops:
                    comp.stop_reason = "eos"
                elif sampler.grammar is not None and sampler.grammar.done_at == st.generated_tokens:
                    comp.stop_reason = "stop"
                elif st.generated_tokens == n:
                    comp.stop_reason = "length"
                yield t
                if comp.stop_reason is not None:
                    return
            if len(history) > self.ctx and keep is not None:   # full: shift, and the next token from there
                t0 = time.perf_counter()
                logits = self._shift(history, keep, comp)
                t2 = time.perf_counter()
                pending = [sampler.sample(logits, history)]
                st.decode_s += t2 - t0
                st.sample_s += time.perf_counter() - t2
                continue
            tok = history[-1]
            pos = len(history) - 1
            # the verified rows pos .. pos + k stay inside the context
            k = min(length.next(), limit, n - st.generated_tokens - 1, self.ctx - 1 - pos)
            t0 = time.perf_counter()
            draft = drafter.propose([seq], [k], ONE_STREAM)[0] if k > 0 else None
            if draft is not None and sampler.grammar is not None:   # drafts the grammar refuses are not verified
                draft = grammar_checked(draft, sampler.grammar)
            t1 = time.perf_counter()
            draft_s += t1 - t0
            st.extra["draft_s"] = round(draft_s, 6)
            if draft is None or not draft.tokens:
                logits = ex.decode(tok, pos)
                self._kv.append(tok)
                t2 = time.perf_counter()
                pending = [sampler.sample(logits, history)]
            else:
                draft.tokens = draft.tokens[:k]
                rows = ex.verify([tok] + draft.tokens, pos)
                t2 = time.perf_counter()
                a, nxt = accept(rows, draft, sampler, history)
                self._kv = history[:pos] + [tok] + draft.tokens[:a]
                st.extra["verify_steps"] += 1
                st.extra["drafted"] += len(draft.tokens)
                st.extra["accepted"] += a
                length.update(len(draft.tokens), a)
                pending = draft.tokens[:a] + [nxt]
            st.decode_s += t2 - t0   # drafting and the target's step; choosing tokens is sampling
            st.sample_s += time.perf_counter() - t2
            d = st.extra["drafted"]
            st.extra["acceptance_rate"] = round(st.extra["accepted"] / d, 4) if d else None

    # --- text in, text out -------------------------------------------------------
    def complete(self, prompt: str | Sequence[int], max_new_tokens: int = 256, *, stream: bool = False,
                 stop: Sequence[str] | str | None = None, special: bool = False, reuse_cache: bool = True,
                 **sampling) -> "str | TextStream":
        """The continuation of raw text (or token ids) as text: the whole of
        it, or with ``stream=True`` an iterator of text pieces. Generation
        ends at an end-of-generation token, at a stop string (never shown)
        or at ``max_new_tokens``/the end of the context; ``last_completion``
        then holds the ids, text and ``stop_reason`` (eos, stop, length).
        ``sampling``: temperature, top_p, top_k, min_p, repeat_penalty, seed,
        and ``grammar`` (``runtime.grammar.json_schema(...)``, ``lark``,
        ``regex``, ``json_object``): the text follows it."""
        ids = self.encode(prompt, bos=True, special=special) if isinstance(prompt, str) else list(prompt)
        return self._text(ids, max_new_tokens, stop, stream, reuse_cache, sampling)

    def chat(self, messages: Sequence[dict], max_new_tokens: int = 256, *, stream: bool = False,
             stop: Sequence[str] | str | None = None, tools: Sequence[dict] | None = None,
             reuse_cache: bool = True, **sampling) -> "str | TextStream":
        """The assistant's reply to ``messages`` (``[{"role", "content"}]``),
        rendered with the model's chat template (``tokenizer.chat_template``);
        the template's text may hold control tokens, the messages' text never
        does. The KV cache keeps the conversation: a next turn prefills only
        what is new. Otherwise as ``complete``; with ``context_shift`` the
        kept tokens are by default the system prompt's (``chat_keep``)."""
        ids = self.tokenizer.chat_ids(messages, add_generation_prompt=True, tools=tools)
        if self.context_shift and sampling.get("keep") is None:
            sampling["keep"] = self.keep if self.keep is not None else chat_keep(self.tokenizer, messages, tools)
        return self._text(ids, max_new_tokens, stop, stream, reuse_cache, sampling)

    def _text(self, ids: list[int], n: int, stops, stream: bool, reuse: bool, sampling: dict
              ) -> "str | TextStream":
        text = TextAssembler(self.tokenizer, ids[-1], stops)   # checks the stop strings first
        tokens = self.generate(ids, n, reuse_cache=reuse, **sampling)
        comp = self.last_completion
        out = TextStream(self._pieces(tokens, text, comp), comp)
        return out if stream else "".join(out)

    def _pieces(self, tokens: Iterator[int], text: TextAssembler, comp: "Completion") -> Iterator[str]:
        stops = set(self.config.stop_ids)
        try:
            for t in tokens:
                if t in stops:
                    break
                out, stopped = text.feed(t)
                if out:
                    comp.text += out
                    yield out
                if stopped:
                    comp.stop_reason, comp.stop_string = "stop", text.stopped
                    return
            out, stopped = text.finish()
            if stopped:
                comp.stop_reason, comp.stop_string = "stop", text.stopped
            if out:
                comp.text += out
                yield out
        except ConstraintError:   # the grammar could not go on: the text so far stays, the error goes up
            comp.stop_reason = "grammar"
            raise
        finally:
            tokens.close()


@dataclass
class Completion:
    """One generation: its prompt, what came out and why it ended."""

    prompt_ids: list[int]
    generated_ids: list[int] = field(default_factory=list)
    text: str = ""
    #: eos (an end-of-generation token), stop (a stop string), length
    #: (max_new_tokens or the context), grammar (one its parser could not follow
    #: further: the stream raised ConstraintError); None while running
    stop_reason: str | None = None
    stop_string: str | None = None
    cached_tokens: int = 0     # prompt tokens whose KV rows came from the last call
    #: after a context shift, the tokens the context holds (the pending one last); None: no shift
    shifted_ids: list[int] | None = None
    stats: GenerationStats = field(default_factory=lambda: GenerationStats())

    def __post_init__(self) -> None:
        self.stats.prompt_tokens = len(self.prompt_ids)

    @property
    def context_ids(self) -> list[int]:
        """The tokens the context holds at the end, in order (the last one's
        row not yet computed): the prompt and the reply, unless a context
        shift dropped some."""
        if self.shifted_ids is None:
            return self.prompt_ids + self.generated_ids
        return list(self.shifted_ids)


class TextStream:
    """Text pieces as they are generated; ``completion`` fills in as they come
    (its ``stop_reason`` is set once the stream is exhausted or closed)."""

    def __init__(self, pieces: Iterator[str], completion: Completion) -> None:
        self._pieces = pieces
        self.completion = completion

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        """Stop generating (a client went away, Ctrl-C): the KV cache keeps
        what was computed."""
        self._pieces.close()
