"""Continuous batching: one engine thread advances every active sequence.

Requests come in from any thread (``submit``, ``cancel``); the engine
thread owns everything else. Each step it

1. admits waiting requests while their blocks fit the paged KV pool
   (a prompt sharing full blocks with one seen before starts past them),
2. runs up to ``prefill_chunk`` tokens of the oldest unfinished prompts,
   so a long prompt never stalls the others' tokens for long,
3. runs one native step for every sequence that is generating: B rows,
   one token each, every weight read once for all of them (with the
   prompt chunks in the same call where the model allows: ``step``); a speculating
   request adds the tokens a drafter proposes (``runtime.pool_drafters``:
   the server's draft model, or prompt lookup when ``Request.lookup`` asks)
   as rows of its own while the step has room, and keeps those the model
   agrees with (``runtime.speculative.accept``; greedy: its output is the
   one plain decoding gives, token for token),
4. samples each sequence's next token with its own sampler, turns tokens
   into text (stop strings held back), and retires finished sequences.

A sequence that needs a block when none is left preempts the youngest
running one, which goes back to the front of the queue and is recomputed
later (its prompt and what it has generated so far; cached blocks make that
cheap). Events (text deltas, the finish, errors) go to each request's
``emit`` callback, from the engine thread.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .block_manager import BlockManager, OutOfBlocks, common_run, prefix_hashes
from .pool_drafters import PoolDrafter, PoolLookup
from .sampling import Sampler, SamplerConfig
from .speculative import MAX_DRAFT_MAX, Draft, DraftLength, accept, draft_sampler
from .stop_strings import TextAssembler


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]     # the most likely ids and their log-probabilities


@dataclass
class Event:
    """What a request hears: text (and the ids and log-probabilities behind
    it) as it is generated, then once a finish reason and the usage."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None     # stop, length, or error
    usage: dict[str, int] | None = None
    error: str | None = None


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplerConfig
    emit: Callable[[Event], None]
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None      # None: off; k: the chosen token's and the k most likely
    id: str = ""
    ignore_eos: bool = False         # run to max_tokens (benchmarks; llama.cpp's and vLLM's field)
    lookup: int = 0                  # prompt lookup: n-gram length of the drafts (0: the engine's drafter, if any)
    draft_max: int = 8               # tokens drafted per step at most (0: no speculation)


class _Seq:
    _ids = itertools.count()

    def __init__(self, req: Request, stop_ids: set[int], tokenizer: Any, vocab: int,
                 drafter: PoolDrafter | None = None) -> None:
        self.key = next(self._ids)
        self.req = req
        self.tokens = list(req.prompt_ids)
        self.n_prompt = len(req.prompt_ids)
        self.computed = 0            # positions whose K/V rows are in the pool
        self.generated = 0
        self.cached_prompt = 0       # prompt tokens found in the pool on first admission
        self.admitted_once = False
        self.sampler = Sampler(req.sampling, vocab)
        self.text = TextAssembler(tokenizer, self.tokens[-1], req.stop)
        self.stop_ids = set() if req.ignore_eos else stop_ids
        self.cancelled = False
        self.t_arrival = time.perf_counter()
        self.drafter = drafter       # who drafts for it (None: plain decoding)
        self.draft_len = DraftLength(req.draft_max) if drafter is not None else None
        self.draft_sampler = draft_sampler(req.sampling, vocab) if drafter is not None else None
        self.draft_kv = 0            # positions whose rows a draft model's own pool holds
        self._hashes: tuple[int, list[bytes]] = (-1, [])

    def block_hashes(self, block_size: int) -> list[bytes]:
        """The hashes of its tokens' full blocks (computed again only when the tokens grew)."""
        if self._hashes[0] != len(self.tokens):
            self._hashes = (len(self.tokens), prefix_hashes(self.tokens, block_size))
        return self._hashes[1]


class EngineError(ValueError):
    """A request the engine cannot take (too long for the context ...)."""


class EngineBusy(Exception):
    """The queue is full, or the engine is draining: try again later."""


class Engine:
    def __init__(self, executor: Any, tokenizer: Any, stop_ids: Sequence[int], vocab: int, max_batch: int,
                 prefill_chunk: int = 64, metrics: Any = None, max_queue: int = 64,
                 drafter: PoolDrafter | None = None) -> None:
        """``max_batch``: sequences advanced together; ``max_queue``: requests
        that may wait beyond them (more are refused with EngineBusy).
        ``drafter``: the draft model requests use unless they ask for prompt
        lookup (``runtime.draft_models.build_pool_drafter``), or None."""
        self.ex = executor
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)
        self.vocab = vocab
        self.ctx = int(executor.pool.ctx)
        self.max_batch = max(1, int(max_batch))
        rows = executor.max_rows or prefill_chunk
        self.prefill_chunk = max(1, min(prefill_chunk, rows))
        self.max_batch = min(self.max_batch, rows, executor.max_batch or rows)
        self.blocks = BlockManager(executor.n_blocks, executor.block_size)
        self.metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.steps = 0
        self.max_queue = max(0, int(max_queue))
        self._outstanding = 0            # submitted and not finished, counted under the lock
        self._lock = threading.Lock()
        self.draining = False
        self.drain_deadline = float("inf")
        self.drafter = drafter
        #: the drafter whose own pool must follow every sequence (a draft model of its own), or None
        self._keeper = drafter if drafter is not None and drafter.own_pool else None
        self._lookups: dict[int, PoolLookup] = {}   # one per n-gram length
        if metrics:
            metrics.observe(self)   # the pool's size is known before the first step

    # --- from any thread ---------------------------------------------------------------------
    def check(self, prompt_ids: Sequence[int], max_tokens: int) -> None:
        """Raise EngineError if a request can never run here."""
        if not prompt_ids:
            raise EngineError("the prompt is empty")
        if len(prompt_ids) >= self.ctx:
            raise EngineError(f"the prompt is {len(prompt_ids)} tokens; the context is {self.ctx} (one more "
                              f"position is needed to generate)")
        if self.blocks.blocks_for(len(prompt_ids) + 1) > self.blocks.n_blocks:
            raise EngineError(f"the prompt needs more KV blocks than the pool has ({self.blocks.n_blocks})")
        if max_tokens < 1:
            raise EngineError("max_tokens must be at least 1")
        if len(prompt_ids) + max_tokens > self.ctx:
            raise EngineError(f"the context is {self.ctx} tokens; the request needs {len(prompt_ids) + max_tokens} "
                              f"({len(prompt_ids)} in the prompt, max_tokens {max_tokens}): shorten the prompt or "
                              f"lower max_tokens")
        bad = [t for t in prompt_ids if not 0 <= int(t) < self.vocab]
        if bad:
            raise EngineError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab - 1})")

    def submit(self, req: Request) -> None:
        """Queue a request; raises EngineError (it can never run here) or
        EngineBusy (not now)."""
        self.check(req.prompt_ids, req.max_tokens)
        if req.lookup < 0 or not 0 <= req.draft_max <= MAX_DRAFT_MAX:
            raise EngineError(f"lookup must be 0 or an n-gram length, and draft_max between 0 (no speculation) and "
                              f"{MAX_DRAFT_MAX} (got {req.lookup}, {req.draft_max})")
        req.sampling.validate()
        with self._lock:
            if self.draining:
                raise EngineBusy("the server is shutting down")
            if self._outstanding >= self.max_batch + self.max_queue:
                raise EngineBusy(f"{self._outstanding} requests are running or queued, the most this server takes")
            self._outstanding += 1
        self._inbox.put(("add", req))
        self._wake.set()

    @property
    def outstanding(self) -> int:
        """Requests submitted and not yet finished."""
        return self._outstanding

    def drain(self, grace_s: float) -> None:
        """Take no new requests; what runs or waits finishes, and whatever is
        left after ``grace_s`` seconds is cut (finish reason ``length``)."""
        with self._lock:
            self.draining = True
            self.drain_deadline = time.monotonic() + max(0.0, grace_s)
        self._wake.set()

    def cancel(self, req_id: str) -> None:
        """Stop a request (its client went away); its blocks are freed."""
        self._inbox.put(("cancel", req_id))
        self._wake.set()

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._loop, name="lmc-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # --- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._intake()
            if not self.waiting and not self.running:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as e:   # never leave clients hanging: fail what was running, keep serving
                for s in list(self.running) + list(self.waiting):
                    self._finish(s, "error", error=f"the engine failed: {type(e).__name__}: {e}")
                self.running, self.waiting = [], deque()

    def _intake(self) -> None:
        while True:
            try:
                what, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if what == "add":
                self.waiting.append(_Seq(arg, self.stop_ids, self.tokenizer, self.vocab, self._drafter_for(arg)))
                if self.metrics:
                    self.metrics.requests.inc()
            else:
                for s in list(self.running) + list(self.waiting):
                    if s.req.id == arg:
                        s.cancelled = True

    def _drafter_for(self, req: Request) -> PoolDrafter | None:
        if req.draft_max == 0:
            return None
        if req.lookup > 0:
            return self._lookups.setdefault(req.lookup, PoolLookup(req.lookup))
        return self.drafter

    def step(self) -> None:
        """One scheduling step (public for tests that drive the engine by hand).
        Where the executor can select rows (``batch_sel``: every row of a
        batch has the decode step's numbers) and nobody speculates, one
        native call runs a row for every generating sequence and up to
        ``prefill_chunk`` prompt tokens of the oldest unfinished prompts,
        returning logits only for the rows that need them (as vLLM's chunked
        prefill does). Otherwise one call runs the generating rows and a
        second the next chunk of the oldest prompt, each row with the
        arithmetic of a single stream's decode or prefill step."""
        self._intake()
        for s in [s for s in list(self.running) + list(self.waiting) if s.cancelled]:
            self._finish(s, None)
        if self.draining and time.monotonic() >= self.drain_deadline:
            for s in list(self.running) + list(self.waiting):
                self._finish(s, "length")
            return
        self._admit()
        # oldest first: a sequence may only preempt younger ones, so each later
        # one checks it is still running
        decoding, prefilling = [], []
        for s in sorted(self.running, key=lambda x: x.key):
            if s not in self.running:
                continue
            if s.computed == len(s.tokens) - 1:
                if self._writable(s, range(s.computed, s.computed + 1)):
                    decoding.append(s)
                else:
                    self._preempt_self(s)
            else:
                prefilling.append(s)
        decoding = [s for s in decoding if s in self.running]
        mixed = self._can_mix(decoding + prefilling)
        rows = self.ex.max_rows or self.prefill_chunk
        budget = min(self.prefill_chunk, rows - len(decoding)) if mixed else self.prefill_chunk
        chunks: list[tuple[_Seq, range]] = []
        for s in prefilling:
            if budget <= 0 or (chunks and not mixed):
                break
            if s not in self.running:
                continue
            lo = s.computed
            hi = min(len(s.tokens), lo + budget)
            if self._writable(s, range(lo, hi)):
                chunks.append((s, range(lo, hi)))
                budget -= hi - lo
            else:
                self._preempt_self(s)
        decoding = [s for s in decoding if s in self.running]
        chunks = [(s, c) for s, c in chunks if s in self.running]
        if mixed and chunks:    # (decode rows alone: ``_decode``, whose head runs for their rows only)
            self._mixed(decoding, chunks)
        else:
            if decoding:
                self._decode(decoding)
            for s, chunk in chunks:
                self._prefill(s, chunk)
        self.steps += 1
        if self.metrics:
            self.metrics.observe(self)

    def _can_mix(self, seqs: list["_Seq"]) -> bool:
        """One call for decode rows and prompt chunks: the executor selects
        rows, and no sequence drafts (drafted rows need their own logits)."""
        return (getattr(self.ex, "can_select", False) and self.drafter is None
                and all(s.drafter is None for s in seqs))

    def _mixed(self, decoding: list["_Seq"], chunks: list[tuple["_Seq", range]]) -> None:
        """One native call: a row for every generating sequence, then the
        prompt chunks; logits come back for the generating rows and the last
        row of each prompt that this step finishes."""
        tokens: list[int] = []
        positions: list[int] = []
        tables: list[list[int]] = []
        select: list[int] = []
        for s in decoding:
            select.append(len(tokens))
            tokens.append(s.tokens[-1])
            positions.append(len(s.tokens) - 1)
            tables.append(self.blocks.table(s.key))
        for s, chunk in chunks:
            tokens += s.tokens[chunk.start: chunk.stop]
            positions += list(chunk)
            tables += [self.blocks.table(s.key)] * len(chunk)
            if chunk.stop == len(s.tokens):
                select.append(len(tokens) - 1)
        logits = self.ex.batch(tokens, positions, _padded(tables), select=select or [0])
        if self.metrics and decoding:
            self.metrics.batch_size.observe(len(decoding))
        for i, s in enumerate(decoding):
            self._count_prompt_row(s)
            s.computed = len(s.tokens)
            self._commit(s, s.tokens)
            self._sampled(s, logits[i])
        r = len(decoding)
        for s, chunk in chunks:
            done = chunk.stop == len(s.tokens)
            self._prefilled(s, chunk, logits[r] if done else None)
            r += done

    def _decode(self, seqs: list["_Seq"]) -> None:
        """One native call for every generating sequence: a row each, with
        the arithmetic of the single-stream decode step (``decode=True``),
        so a request's tokens do not depend on who else is being served;
        drafted tokens add rows of their sequence, checked in the same call."""
        drafts = self._drafts(seqs)
        tokens: list[int] = []
        positions: list[int] = []
        tables: list[list[int]] = []
        for s, d in zip(seqs, drafts):
            p = len(s.tokens) - 1
            tokens += [s.tokens[-1], *d.tokens]
            positions += range(p, p + 1 + len(d.tokens))
            tables += [self.blocks.table(s.key)] * (1 + len(d.tokens))
        logits = self.ex.batch(tokens, positions, _padded(tables), decode=True)
        if self.metrics:
            self.metrics.batch_size.observe(len(seqs))
        r = 0
        for s, d in zip(seqs, drafts):
            n = len(d.tokens)
            rows = logits[r: r + 1 + n]
            r += 1 + n
            self._count_prompt_row(s)
            if not n:
                s.computed = len(s.tokens)
                self._commit(s, s.tokens)
                self._sampled(s, rows[0])
                continue
            n_ok, nxt = accept(rows, d, s.sampler, s.tokens)
            s.draft_len.update(n, n_ok)
            if self.metrics:
                self.metrics.draft_tokens.inc(n)
                self.metrics.accepted_tokens.inc(n_ok)
            # the KV rows of the accepted drafts stay (the draft's own too); a rejected one's row is written
            # again later
            s.draft_kv = min(s.draft_kv, len(s.tokens) + n_ok)
            s.computed = len(s.tokens) + n_ok
            self._commit(s, s.tokens + d.tokens[:n_ok])
            for i, tok in enumerate([*d.tokens[:n_ok], nxt]):
                if not self._emit_token(s, tok, rows[i]):
                    break

    def _commit(self, s: _Seq, tokens: list[int]) -> None:
        """Cache ``s``'s full blocks of ``tokens`` that both pools hold (a
        draft model's rows may lag the target's by its last accepted draft)."""
        n = min(s.computed, s.draft_kv) if self._keeper is not None else s.computed
        self.blocks.commit(s.key, tokens[:n])

    def _drafts(self, seqs: list["_Seq"]) -> list[Draft]:
        """Per sequence, the tokens its drafter proposes this step, while the
        step's rows (``executor.max_batch``) and free blocks allow (a draft
        never preempts anyone); the rows are shared fairly. Each drafter
        proposes for all its sequences at once; a draft model with a pool
        of its own also hears of every other sequence, to keep its rows."""
        wants = []
        for s in seqs:
            n = s.draft_len.next() if s.draft_len is not None else 0
            wants.append(max(0, min(n, s.req.max_tokens - s.generated - 1, self.ctx - len(s.tokens))))
        ns = share_rows(wants, (self.ex.max_batch or self.max_batch) - len(seqs))
        groups: dict[PoolDrafter, list[int]] = {}
        for i, s in enumerate(seqs):
            if self._keeper is not None:
                groups.setdefault(self._keeper, []).append(i)
            if ns[i] > 0 and s.drafter is not self._keeper:
                groups.setdefault(s.drafter, []).append(i)
        out = [Draft() for _ in seqs]
        for drafter, idx in groups.items():
            mine = [ns[i] if seqs[i].drafter is drafter else 0 for i in idx]
            for i, d in zip(idx, drafter.propose([seqs[i] for i in idx], mine, self)):
                if d.tokens:
                    out[i] = d
        return out

    # --- for drafters (runtime.pool_drafters.DraftPool) -----------------------------------------
    def make_room(self, s: _Seq, n: int) -> int:
        """Blocks for the ``n`` positions after ``s``'s tokens, without
        preempting anyone; how many (from the first) have one."""
        start = len(s.tokens)
        for k in range(n):
            if not self._writable(s, range(start + k, start + k + 1), preempt=False):
                return k
        return n

    def table(self, s: _Seq) -> list[int]:
        return self.blocks.table(s.key)

    def _prefill(self, s: "_Seq", chunk: range) -> None:
        """The next chunk of one prompt, with the arithmetic of the
        single-stream prefill; only its last row's logits come back."""
        logits = self.ex.batch(s.tokens[chunk.start: chunk.stop], list(chunk),
                               [self.blocks.table(s.key)] * len(chunk), last_only=True)
        if self.drafter is not None:
            self.drafter.prefill(s, chunk.stop, self.blocks.table(s.key))
        self._prefilled(s, chunk, logits if chunk.stop == len(s.tokens) else None)

    def _count_prompt_row(self, s: "_Seq") -> None:
        """A decode row that runs a prompt's last token (the chunk before it
        stopped one short, or the cache held all the rest) is a prompt token
        run through the model too."""
        if self.metrics and s.computed < s.n_prompt:
            self.metrics.prompt_tokens.inc()

    def _prefilled(self, s: "_Seq", chunk: range, logits: np.ndarray | None) -> None:
        """A chunk of ``s``'s prompt is in the pool; ``logits``: its last
        row's, when the chunk finished the prompt."""
        s.computed = chunk.stop
        self._commit(s, s.tokens)
        if self.metrics:
            self.metrics.prompt_tokens.inc(len(chunk))
        if logits is not None:
            self._sampled(s, logits)

    def _admit(self) -> None:
        """Waiting sequences in order while there is room, except one whose
        prompt shares full blocks with a prompt still being prefilled: it
        waits until they are in the pool and then shares them (SGLang's
        in-batch prefix caching), rather than computing them beside it. So
        8 requests with one system prompt, arriving together, prefill it
        once. It loses no time: prefill goes oldest first anyway."""
        for s in list(self.waiting):
            if len(self.running) >= self.max_batch:
                return
            if self._prefix_in_flight(s):
                continue
            try:
                _, cached = self.blocks.allocate(s.key, s.tokens, s.block_hashes(self.blocks.block_size))
            except OutOfBlocks:
                return
            self.waiting.remove(s)
            self._copy_blocks(self.blocks.copies(s.key))    # a cached block's first positions, reused
            # at least the last token runs: its logits give the next one
            s.computed = s.draft_kv = min(cached, len(s.tokens) - 1)
            if not s.admitted_once:
                s.cached_prompt, s.admitted_once = s.computed, True
                if self.metrics:
                    self.metrics.cached_prompt_tokens.inc(s.computed)
            self.running.append(s)

    def _prefix_in_flight(self, s: _Seq) -> bool:
        """A running sequence is prefilling full blocks that ``s``'s prompt
        starts with and the pool does not hold yet."""
        bs = self.blocks.block_size
        mine = s.block_hashes(bs)
        have = self.blocks.cached_run(mine)
        if have == len(mine):
            return False
        for r in self.running:
            if r.computed >= len(r.tokens) - 1:
                continue      # generating: its blocks so far are in the pool (or never will be)
            n = common_run(mine, r.block_hashes(bs))
            if n > have and r.computed < n * bs:
                return True
        return False

    def _writable(self, s: _Seq, positions: range, preempt: bool = True) -> bool:
        """Blocks for ``positions`` of ``s``, copying shared ones; False when
        the pool is full even after preempting everything younger (with
        ``preempt=False``, as soon as it is full: drafts never preempt)."""
        for p in positions:
            while True:
                try:
                    self._copy_blocks(self.blocks.ensure(s.key, p))
                    break
                except OutOfBlocks:
                    if not (preempt and self._preempt_younger_than(s)):
                        return False
        return True

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """The block manager's (src, dst) copies, in the pool and the drafter's."""
        for src, dst in copies:
            self.ex.copy_block(src, dst)
            if self.drafter is not None:
                self.drafter.copy_block(src, dst)

    def _preempt_younger_than(self, s: _Seq) -> bool:
        victims = [v for v in self.running if v is not s and v.key > s.key]
        if not victims:
            return False
        v = max(victims, key=lambda x: x.key)
        self.running.remove(v)
        self.blocks.release(v.key)
        v.computed = 0
        self.waiting.appendleft(v)     # recomputed (prompt and generated so far) when there is room again
        if self.metrics:
            self.metrics.preemptions.inc()
        return True

    def _preempt_self(self, s: _Seq) -> None:
        """No block for ``s`` even after preempting younger ones: it waits for
        older ones to finish; alone, it has the whole pool and can only stop."""
        if len(self.running) == 1:
            self._finish(s, "length")
            return
        self.running.remove(s)
        self.blocks.release(s.key)
        s.computed = 0
        self.waiting.appendleft(s)

    def _sampled(self, s: _Seq, logits: np.ndarray) -> None:
        """Sample ``s``'s next token from ``logits`` and tell its request."""
        self._emit_token(s, s.sampler.sample(logits, s.tokens), logits)

    def _emit_token(self, s: _Seq, tok: int, logits: np.ndarray) -> bool:
        """Append ``tok`` (chosen from ``logits``) to ``s`` and tell its
        request; False once ``s`` has finished."""
        s.tokens.append(tok)
        s.generated += 1
        if self.metrics:
            self.metrics.generated_tokens.inc()
        ev = Event(token_ids=[tok])
        if s.req.logprobs is not None:
            ev.logprobs = [_logprob(logits, tok, s.req.logprobs)]
        finish = None
        if tok in s.stop_ids:
            finish = "stop"
        else:
            ev.text, stopped = s.text.feed(tok)
            if stopped:
                finish = "stop"
        if finish is None and (s.generated >= s.req.max_tokens or len(s.tokens) >= self.ctx):
            finish = "length"
        if finish is None:
            s.req.emit(ev)
            return True
        if not s.text.stopped:   # the end: what was held back (a partial character, a stop string's start) shows
            ev.text += s.text.finish()[0]
        self._finish(s, finish, ev)
        return False

    def _finish(self, s: _Seq, reason: str | None, ev: Event | None = None, error: str | None = None) -> None:
        if s in self.running:
            self.running.remove(s)
            self.blocks.release(s.key)
        elif s in self.waiting:
            self.waiting.remove(s)
        else:
            return   # finished already
        with self._lock:
            self._outstanding -= 1
        if reason is None:      # cancelled: nobody listens any more
            return
        ev = ev or Event()
        ev.finish_reason, ev.error = reason, error
        ev.usage = {"prompt_tokens": s.n_prompt, "completion_tokens": s.generated,
                    "total_tokens": s.n_prompt + s.generated, "cached_tokens": s.cached_prompt}
        s.req.emit(ev)


def share_rows(wants: list[int], room: int) -> list[int]:
    """Rows for each want, at most ``room`` in all: equal shares, no one
    more than it wants, the oldest (first) taking what does not divide."""
    got = [0] * len(wants)
    while room > 0:
        hungry = [i for i, w in enumerate(wants) if got[i] < w]
        if not hungry:
            break
        each = max(1, room // len(hungry))
        for i in hungry:
            g = min(each, wants[i] - got[i], room)
            got[i] += g
            room -= g
            if room == 0:
                break
    return got


def _padded(tables: list[list[int]]) -> list[list[int]]:
    """Block tables as one rectangle (entries past a row's blocks are never read)."""
    width = max(len(t) for t in tables)
    return [t + [0] * (width - len(t)) for t in tables]


def _logprob(logits: np.ndarray, tok: int, k: int) -> TokenLogprob:
    """The chosen token's log-probability and the k most likely, from the
    model's raw distribution (before penalties and temperature, as llama.cpp
    and OpenAI report them)."""
    x = np.asarray(logits, np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    top: list[tuple[int, float]] = []
    if k > 0:
        ids = np.argpartition(-x, min(k, x.size - 1))[:k]
        ids = ids[np.argsort(-x[ids], kind="stable")]
        top = [(int(i), float(x[i] - lse)) for i in ids]
    return TokenLogprob(int(tok), float(x[tok] - lse), top)
