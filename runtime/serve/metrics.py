"""The server's Prometheus metrics (prometheus_client, text format on /metrics).

The engine thread updates them (``Engine(metrics=...)``): requests as they
come in; after every step, the counters by what the step counted
(``record``) and the gauges by the engine's load (``observe``).
"""
from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine.plan import EngineLoad, StepStats

#: generated tokens per second are averaged over this many seconds
RATE_WINDOW_S = 10.0


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("lmc_requests", "Requests the engine accepted", registry=r)
        self.http_errors = Counter("lmc_http_errors", "Requests refused with a 4xx answer", ["status"], registry=r)
        self.prompt_tokens = Counter("lmc_prompt_tokens", "Prompt tokens run through the model (tokens found in "
                                     "the KV cache are not run)", registry=r)
        self.cached_prompt_tokens = Counter("lmc_cached_prompt_tokens", "Prompt tokens found in the KV cache",
                                            registry=r)
        self.generated_tokens = Counter("lmc_generated_tokens", "Tokens generated", registry=r)
        self.draft_tokens = Counter("lmc_draft_tokens", "Tokens proposed by a drafter (draft model, the model's "
                                    "first layers or prompt lookup) and checked by the model", registry=r)
        self.accepted_tokens = Counter("lmc_draft_accepted_tokens", "Proposed tokens the model agreed with",
                                       registry=r)
        self.preemptions = Counter("lmc_preemptions", "Sequences sent back to the queue for lack of KV blocks",
                                   registry=r)
        self.context_shifts = Counter("lmc_context_shifts", "Sequences that filled the context and were shifted "
                                      "(--context-shift)", registry=r)
        self.masked_steps = Counter("lmc_grammar_masked_steps", "Tokens chosen under a grammar's mask (structured "
                                    "output)", registry=r)
        self.mask_seconds = Counter("lmc_grammar_mask_seconds", "Seconds spent computing grammar masks", registry=r)
        self.queue_depth = Gauge("lmc_queue_depth", "Requests waiting for room in the batch or the KV pool",
                                 registry=r)
        self.running = Gauge("lmc_running_sequences", "Sequences in the batch", registry=r)
        self.kv_blocks_used = Gauge("lmc_kv_blocks_used", "KV pool blocks held by sequences", registry=r)
        self.kv_blocks_cached = Gauge("lmc_kv_blocks_cached", "KV pool blocks kept for prefix reuse, evictable",
                                      registry=r)
        self.kv_blocks_total = Gauge("lmc_kv_blocks_total", "KV pool blocks", registry=r)
        self.batch_size = Histogram("lmc_batch_size", "Sequences advanced by one decode step",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64), registry=r)
        self.tokens_per_second = Gauge("lmc_generation_tokens_per_second",
                                       f"Tokens generated per second over the last {RATE_WINDOW_S:g} s", registry=r)
        self._recent: deque[tuple[float, float]] = deque()

    def record(self, st: StepStats) -> None:
        """What an engine step counted."""
        for counter, n in ((self.prompt_tokens, st.prompt_tokens), (self.cached_prompt_tokens, st.cached_prompt_tokens),
                           (self.generated_tokens, st.generated_tokens), (self.draft_tokens, st.draft_tokens),
                           (self.accepted_tokens, st.accepted_tokens), (self.preemptions, st.preemptions),
                           (self.context_shifts, st.context_shifts),
                           (self.masked_steps, st.masked_steps), (self.mask_seconds, st.mask_s)):
            if n:
                counter.inc(n)
        if st.batch_size is not None:
            self.batch_size.observe(st.batch_size)

    def observe(self, load: EngineLoad) -> None:
        """After an engine step: the gauges."""
        self.queue_depth.set(load.waiting)
        self.running.set(load.running)
        self.kv_blocks_total.set(load.kv_blocks_total)
        self.kv_blocks_cached.set(load.kv_blocks_cached)
        self.kv_blocks_used.set(load.kv_blocks_used)
        now = time.monotonic()
        total = self.registry.get_sample_value("lmc_generated_tokens_total") or 0.0
        self._recent.append((now, total))
        while len(self._recent) > 2 and now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()
        t0, c0 = self._recent[0]
        self.tokens_per_second.set((total - c0) / (now - t0) if now > t0 else 0.0)

    def text(self) -> bytes:
        return generate_latest(self.registry)
