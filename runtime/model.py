"""The Python API: ``load(path)`` gives a model that encodes, decodes,
generates and scores text."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from compiler.artifact import Artifact, is_artifact
from compiler.driver import BatchOptions, CompileOptions, LoadedModel, build_graphs, load_model
from ir.types import KV_TYPES

from .executor import InterpExecutor
from .sampling import Sampler, SamplerConfig
from .speculative import DraftLength, Speculation, SpeculationError, accept, common_prefix
from .stop_strings import TextAssembler


#: KV cache length when the user gives none: a model's own context can be
#: 32768 or more, which would cost gigabytes of cache up front (-c raises it)
DEFAULT_CTX = 4096


class RunError(ValueError):
    """A request the model cannot serve (prompt too long, bad token id ...)."""


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


def _return_freed_memory() -> None:
    """Loading and planning leave freed heap behind (graphs, the tokenizer's
    build); under a budget, give it back to the system before the run
    grows the resident set (glibc keeps freed memory otherwise)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):   # not glibc
        pass


class Model:
    """A loaded, compiled model with its own KV cache."""

    def __init__(self, loaded: LoadedModel, backend: str = "llvm", ctx: int | None = None,
                 threads: int | None = None, artifact: Artifact | None = None,
                 use_cache: bool = True, passes: tuple[str, ...] | None = None,
                 mem_budget: int | None = None, stream: str | None = None, kv_type: str | None = None,
                 stream_io: str = "pread", status: Callable[[str], None] | None = None,
                 batch: BatchOptions | None = None, speculation: Speculation | None = None) -> None:
        """``passes``: the compiler's pass list; None for the backend's default
        (``compiler.pipeline.default_pipeline``). ``mem_budget``: bytes of
        peak resident memory for the whole process (llvm backend): weights
        may stream from disk and the KV cache shrink to fit. ``kv_type``: KV
        cache storage, f32 (the default), f16 or q8; None lets a budget choose.
        ``status(text)`` is told of slow steps (a terminal's status line).
        ``batch``: build for batched serving instead (a paged KV pool,
        ``executor.batch``/``copy_block``; see ``runtime.paged``): the
        single-stream methods (generate, logits ...) are then unavailable.
        ``speculation``: decode speculatively (``runtime.speculative``): a
        drafter proposes tokens and one ``verify`` step checks them."""
        cfg = loaded.config
        if ctx is not None and not 0 < ctx <= cfg.seq_len:
            raise RunError(f"--ctx {ctx}: must be between 1 and the model's context {cfg.seq_len}")
        if threads is not None and not 0 < threads <= 256:
            raise RunError(f"--threads {threads}: must be between 1 and 256")
        if kv_type is not None and kv_type not in KV_TYPES:
            raise RunError(f"--kv-type {kv_type}: unknown KV cache type (one of {', '.join(KV_TYPES)})")
        if batch is not None and (mem_budget is not None or stream):
            raise RunError("batched serving does not take a memory budget or streamed weights yet")
        if speculation is not None:
            if batch is not None:
                raise RunError("speculative decoding runs a single stream, not batched serving")
            try:
                speculation.validate()
            except SpeculationError as e:
                raise RunError(str(e)) from None
        self.loaded = loaded
        self.config = cfg
        self.tokenizer = loaded.tokenizer
        self.ctx = ctx or min(cfg.seq_len, DEFAULT_CTX)
        self.compile_info: dict = {}
        if batch is not None:
            try:
                batch = batch.resolved(self.ctx)
            except ValueError as e:
                raise RunError(str(e)) from None
        if backend == "interp":
            from compiler.native import DEFAULT_PREFILL_CHUNK

            self.executor = InterpExecutor(build_graphs(loaded, CompileOptions(backend=backend, ctx=self.ctx,
                                                                                passes=passes,
                                                                                kv_type=kv_type or "f32",
                                                                                batch=batch,
                                                                                verify=speculation is not None)),
                                           max_rows=max(DEFAULT_PREFILL_CHUNK, batch.max_batch) if batch else None)
            self.kv_type = kv_type or "f32"
            self.kv_bytes = sum(int(a.nbytes) for a in self.executor.state.values())
        elif backend == "llvm":
            from compiler.native import NativeOptions, compile_native
            from .native import NativeExecutor

            if artifact is None:
                opts = NativeOptions(ctx=self.ctx, use_cache=use_cache, passes=passes, kv_type=kv_type or "f32",
                                     progress=status, batch=batch, verify=speculation is not None)
                if mem_budget is not None or stream:
                    opts.mem_budget, opts.auto_ctx, opts.threads = mem_budget, ctx is None, threads
                    opts.auto_kv, opts.stream, opts.stream_io = True, stream, stream_io
                if kv_type is not None:
                    opts.auto_kv = False  # the user chose the KV cache type
                res = _compile_within_budget(loaded, opts) if opts.mem_budget is not None and use_cache \
                    else compile_native(loaded, opts)
                artifact = res.artifact
                self.compile_info = {"compile_s": round(res.seconds, 4), "cache_hit": res.cached}
                if res.kernels is not None:
                    self.compile_info.update(kernels_compiled=res.kernels.compiled,
                                             kernels_cached=res.kernels.cached)
                if res.child_peak:
                    self.compile_info["compile_child_peak_bytes"] = res.child_peak
                if status is not None and not res.cached:
                    status(f"compiled for this CPU in {res.seconds:.1f} s" + (" (cached for next time)" if use_cache else ""))
            elif mem_budget is not None:
                _check_artifact_budget(artifact, mem_budget, loaded.path)
            self.ctx = int(artifact.manifest["ctx"])
            if artifact.manifest.get("batch"):
                b = artifact.manifest["batch"]
                batch = BatchOptions(int(b["block_size"]), int(b["n_blocks"]), int(b["max_batch"]))
            self.kv_type = artifact.manifest.get("kv_type", "f32")
            self.kv_bytes = int(artifact.manifest["state_bytes"])
            self.executor = NativeExecutor(artifact, loaded.path, threads)
        else:
            raise RunError(f"--backend {backend}: unknown backend (available: llvm, interp)")
        self.backend = backend
        #: the KV pool's options when built for batched serving, else None
        self.batch = batch
        self.last_stats = GenerationStats()
        self.last_completion: Completion | None = None
        self._kv: list[int] = []   # the ids whose K/V rows the cache holds, from position 0
        self._build = dict(backend=backend, threads=threads, use_cache=use_cache, passes=passes, status=status)
        #: how generate decodes: speculatively with this drafter, or plainly (None)
        self.speculation: Speculation | None = None
        self.drafter = None
        if speculation is not None:
            from .draft_models import build_drafter

            self.drafter = build_drafter(self, speculation)
            self.speculation = speculation
        if mem_budget is not None:
            _return_freed_memory()

    # --- text --------------------------------------------------------------
    def encode(self, text: str, bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of ``text``; ``special=True`` also recognises control
        tokens written in it (``<|im_start|>``), as llama.cpp's parse_special."""
        return self.tokenizer.encode(text, bos=bos, special=special)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    # --- numbers -------------------------------------------------------------
    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        if self.batch is not None:
            raise RunError("this model was built for batched serving (batch=...): run it through "
                           "model.executor.batch(), not generate/logits/complete/chat")
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
                 seed: int | None = None, stop: bool = True, reuse_cache: bool = False) -> Iterator[int]:
        """Yield new token ids. The prompt goes through one prefill pass; a
        sampled stop token is yielded and ends generation. Generation also
        ends when the context is full, whatever ``max_new_tokens`` says (as
        run.c clips its steps); ``last_completion.stop_reason`` then says
        ``length`` (``eos`` after a stop token). ``reuse_cache``: keep the KV
        rows of the longest prefix the cache already holds from the last
        call and prefill only the rest (a chat's earlier turns)."""
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        ids = self._check_ids(ids)
        if max_new_tokens < 0:
            raise RunError(f"-n {max_new_tokens}: must be >= 0")
        cfg = SamplerConfig(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            repeat_penalty=repeat_penalty, seed=seed)
        cfg.validate()
        sampler = Sampler(cfg, self.config.vocab_size)
        # positions P-1 .. ctx-1 each give one token: at most ctx - P + 1
        n = min(max_new_tokens, self.ctx - len(ids) + 1)
        comp = self.last_completion = Completion(prompt_ids=ids)
        self.last_stats = comp.stats
        if self.drafter is not None and self.speculation is not None:
            self.drafter.begin(cfg)
            return self._generate_speculative(ids, n, sampler, stop, reuse_cache, comp)
        return self._generate(ids, n, sampler, stop, reuse_cache, comp)

    def _prefill(self, ids: list[int], reuse: bool) -> np.ndarray:
        """Logits after ``ids``, running only what the cache lacks when
        ``reuse`` (at least the last token, whose logits are needed)."""
        start = 0
        if reuse:
            start = min(common_prefix(ids, self._kv), len(ids) - 1)
        if start == 0:
            self.executor.reset()
        self._kv = ids[:start]   # rows past start are overwritten from here on
        logits = self.executor.prefill(ids[start:], start)
        self._kv = list(ids)
        self.last_completion.cached_tokens = start
        return logits

    def _generate(self, ids: list[int], n: int, sampler: Sampler, stop: bool, reuse: bool,
                  comp: "Completion") -> Iterator[int]:
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
            elif i == n - 1:
                comp.stop_reason = "length"
            yield tok
            if comp.stop_reason is not None:
                return
            t0 = time.perf_counter()
            logits = self.executor.decode(tok, pos)
            self._kv.append(tok)
            st.decode_s += time.perf_counter() - t0
            pos += 1
            if streams:  # the compute / I/O split of the decode steps so far
                io = self.executor.stream_stats()
                wait = io["io_wait_s"] - io1["io_wait_s"]
                st.extra.update(decode_io_wait_s=round(wait, 6), decode_compute_s=round(st.decode_s - wait, 6),
                                read_bytes=io["read_bytes"] - io0["read_bytes"],
                                read_s=round(io["read_s"] - io0["read_s"], 6))

    def _generate_speculative(self, ids: list[int], n: int, sampler: Sampler, stop: bool, reuse: bool,
                              comp: "Completion") -> Iterator[int]:
        """``_generate`` with a drafter: the first token comes from the
        prefill as plain decoding's does; then each step drafts up to
        ``draft_max`` tokens and runs the pending token and the drafts
        through ``verify`` in one step (a plain decode step when nothing
        was drafted), keeping the accepted drafts and the target's own next
        token; the cache's rows past them are stale and get overwritten."""
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
        t0 = time.perf_counter()
        logits = self._prefill(ids, reuse)
        st.prefill_s = time.perf_counter() - t0
        st.extra["cached_tokens"] = comp.cached_tokens
        history = list(ids)
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
                elif st.generated_tokens == n:
                    comp.stop_reason = "length"
                yield t
                if comp.stop_reason is not None:
                    return
            tok = history[-1]
            pos = len(history) - 1
            k = min(length.next(), limit, n - st.generated_tokens - 1)
            t0 = time.perf_counter()
            drafter.sync(self._kv)
            draft = drafter.propose(history, k) if k > 0 else None
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
        ``sampling``: temperature, top_p, top_k, min_p, repeat_penalty, seed."""
        ids = self.encode(prompt, bos=True, special=special) if isinstance(prompt, str) else list(prompt)
        return self._text(ids, max_new_tokens, stop, stream, reuse_cache, sampling)

    def chat(self, messages: Sequence[dict], max_new_tokens: int = 256, *, stream: bool = False,
             stop: Sequence[str] | str | None = None, tools: Sequence[dict] | None = None,
             reuse_cache: bool = True, **sampling) -> "str | TextStream":
        """The assistant's reply to ``messages`` (``[{"role", "content"}]``),
        rendered with the model's chat template (``tokenizer.chat_template``);
        the template's text may hold control tokens, the messages' text never
        does. The KV cache keeps the conversation: a next turn prefills only
        what is new. Otherwise as ``complete``."""
        ids = self.tokenizer.chat_ids(messages, add_generation_prompt=True, tools=tools)
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
        finally:
            tokens.close()


@dataclass
class Completion:
    """One generation: its prompt, what came out and why it ended."""

    prompt_ids: list[int]
    generated_ids: list[int] = field(default_factory=list)
    text: str = ""
    #: eos (an end-of-generation token), stop (a stop string), length
    #: (max_new_tokens or the context); None while running
    stop_reason: str | None = None
    stop_string: str | None = None
    cached_tokens: int = 0     # prompt tokens whose KV rows came from the last call
    stats: GenerationStats = field(default_factory=lambda: GenerationStats())

    def __post_init__(self) -> None:
        self.stats.prompt_tokens = len(self.prompt_ids)


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


def _separate_tokenizer(model_path: str, tokenizer: str | None) -> str | None:
    """The tokenizer file to pass along, or None when the model carries its
    own (GGUF, QSF: its tokenizer's path is the model's)."""
    # realpath: the tokenizer records its resolved path, the model path may pass through a symlink
    if tokenizer is None or os.path.realpath(tokenizer) == os.path.realpath(model_path):
        return None
    return tokenizer


def _compile_child(path: str, tokenizer: str | None, opts, said=None) -> None:
    """``said``: a queue the child's progress lines go to (the parent's status line)."""
    from compiler.native import compile_native

    if said is not None:
        import dataclasses

        opts = dataclasses.replace(opts, progress=lambda text: said.put(f"{text} (in a child process, to stay "
                                                                        f"within the budget)"))
    compile_native(load_model(path, tokenizer), opts)
    from compiler.codegen.k_sampler import prepare

    prepare()   # sampling's own native code, so the parent starts no LLVM either


def _check_artifact_budget(artifact: Artifact, budget: int, model_path: str) -> None:
    """A compiled model runs with the memory plan it was compiled for: refuse
    a budget smaller than that plan (or a budget at all, when it was compiled
    without one and so keeps every weight resident) instead of exceeding it."""
    from passes.memory_budget import fmt_size

    plan = artifact.manifest.get("memory")
    again = f"compile it again for this budget (`lmc compile {model_path} --mem-budget {_size_arg(budget)} -o ...`)"
    if not plan:
        raise RunError(f"--mem-budget {fmt_size(budget)}: this compiled model was built without a memory budget "
                       f"(every weight resident); {again}")
    if int(plan["total"]) > budget:
        raise RunError(f"--mem-budget {fmt_size(budget)}: this compiled model was planned for "
                       f"{fmt_size(int(plan['total']))} ({plan.get('describe', '')}); {again}")


def _compile_within_budget(loaded: LoadedModel, opts):
    """With a memory budget, LLVM runs in a child process that fills the
    compile cache, one kernel module at a time (``jobs=1``); this process
    then loads the artifact, so its own peak stays within the budget. Where
    the child would need more than the budget, refuse and say how to
    compile once elsewhere (``lmc compile``: its artifacts and cache
    entries then run within the budget)."""
    import dataclasses
    import multiprocessing

    from compiler.compile_memory import compile_peak_estimate, resident_bytes
    from compiler.native import compile_native
    from passes.memory_budget import fmt_size

    t0 = time.perf_counter()
    res = compile_native(loaded, dataclasses.replace(opts, lookup_only=True))  # plans; BudgetError here
    if res is not None:
        return res
    here = resident_bytes()
    need = compile_peak_estimate(here) if here is not None else None
    if need is not None and need > opts.mem_budget:
        name = os.path.basename(loaded.path)
        flags = f" -t {opts.threads}" if opts.threads else ""   # the plan's scratch is per thread
        tok = _separate_tokenizer(loaded.path, getattr(loaded.tokenizer, "path", None))
        flags += f" -z {tok}" if tok else ""
        raise RunError(f"--mem-budget {fmt_size(opts.mem_budget)}: compiling {name} for this CPU needs about "
                       f"{fmt_size(need)} once (LLVM), more than the budget; compile it once where that fits "
                       f"(`lmc compile {loaded.path} --mem-budget {_size_arg(opts.mem_budget)}{flags} -o "
                       f"{os.path.splitext(name)[0]}.lmc`, on this machine or one with the same CPU), "
                       f"then its runs stay within the budget")
    if opts.progress is not None:
        opts.progress("compiling for this CPU, once (in a child process, to stay within the budget)")
    mp = multiprocessing.get_context("spawn")
    said = mp.SimpleQueue() if opts.progress is not None else None
    child = mp.Process(
        target=_compile_child, args=(loaded.path, _separate_tokenizer(loaded.path, getattr(loaded.tokenizer, "path",
                                                                                           None)),
                                     # a callback does not pickle; one kernel module in memory at a time
                                     dataclasses.replace(opts, progress=None, jobs=1), said),
        name="lmc-compile")
    child.start()
    while True:
        child.join(0.1)
        while said is not None and not said.empty():
            text = said.get()
            (getattr(opts.progress, "update", None) or opts.progress)(text)
        if child.exitcode is not None:
            break
    res = compile_native(loaded, dataclasses.replace(opts, lookup_only=True))
    if res is None:  # the child failed: compile here after all, and say so in the stats
        res = compile_native(loaded, opts)
    res.cached, res.seconds = False, time.perf_counter() - t0
    res.child_peak = _largest_child_rss()
    return res


def _size_arg(n: int) -> str:
    """``n`` bytes as a --mem-budget argument (``parse_size``'s M and G are binary)."""
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _largest_child_rss() -> int | None:
    """Peak resident bytes of the largest child process waited for (Linux
    reports KiB): the compile child's peak, for the stats."""
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 or None
    except (ImportError, OSError):
        return None


def load(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None, backend: str = "llvm",
         ctx: int | None = None, threads: int | None = None, use_cache: bool = True,
         passes: tuple[str, ...] | None = None, mem_budget: int | None = None,
         stream: str | None = None,
         kv_type: str | None = None, stream_io: str = "pread",
         status: Callable[[str], None] | None = None, batch: BatchOptions | None = None,
         speculation: Speculation | None = None) -> Model:
    """Load a model file (llama2.c .bin, GGUF, QSF) or a compiled artifact
    (``lmc compile``) and make it ready to run; native code comes from the
    compile cache when it can. ``status(text)`` hears about the slow steps
    of a cold start (``runtime.status.StatusLine`` draws them on a terminal).
    ``batch`` (``BatchOptions(block_size, n_blocks, max_batch)``) builds it
    for batched serving: a paged KV pool driven through
    ``model.executor.batch(tokens, positions, tables)``. ``speculation``
    (``Speculation(lookup=3)``, ``(draft="small.gguf")``, ``(draft_layers=6)``)
    makes generate/complete/chat decode speculatively: greedy output is
    plain decoding's, token for token."""
    if status is not None:
        status(_loading_text(os.fspath(path)))
    if is_artifact(path):
        from compiler.native import check_artifact

        art = Artifact.read(path)
        check_artifact(art, os.fspath(path))
        man = art.manifest
        loaded = load_model(man["model"]["path"],
                            tokenizer or _separate_tokenizer(man["model"]["path"], man.get("tokenizer")))
        if backend != "llvm":
            raise RunError(f"{path}: an artifact runs on the llvm backend only")
        if kv_type is not None and kv_type != man.get("kv_type", "f32"):
            raise RunError(f"{path}: compiled with --kv-type {man.get('kv_type', 'f32')}, not {kv_type} "
                           f"(recompile it with --kv-type {kv_type})")
        if batch is not None and not man.get("batch"):
            raise RunError(f"{path}: not compiled for batched serving")
        return Model(loaded, "llvm", ctx=man["ctx"], threads=threads, artifact=art, speculation=speculation,
                     mem_budget=mem_budget)
    return Model(load_model(path, tokenizer), backend=backend, ctx=ctx, threads=threads, use_cache=use_cache,
                 passes=passes, mem_budget=mem_budget, stream=stream, kv_type=kv_type, stream_io=stream_io,
                 status=status, batch=batch, speculation=speculation)


def _loading_text(path: str) -> str:
    """What a cold load is about to do: a GGUF whose metadata was never read
    takes seconds (a large vocabulary), every later load milliseconds."""
    from frontends import gguf_cache

    name = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            first = f.read(4) == b"GGUF"
    except OSError:
        return f"loading {name}"
    if first and not gguf_cache.is_cached(path):
        return f"loading {name}: reading its metadata and vocabulary, once"
    return f"loading {name}"


def load_tokenizer(path: str | os.PathLike, vocab_size: int | None = None):
    """The tokenizer alone: from a llama2.c tokenizer.bin (``vocab_size``:
    its checkpoint's), a GGUF file (a model or a vocabulary-only file) or a
    QSF model. ``encode(text, bos=True)``, ``decode(ids)``."""
    from compiler.driver import load_tokenizer_file

    return load_tokenizer_file(path, vocab_size)
