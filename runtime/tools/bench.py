"""The single-stream benchmark (``lmc bench``): compile time, prefill and
decode speed, memory, and how close each comes to its roofline, measured
side by side in one process; and llama.cpp's and OpenVINO GenAI's speed on
the same file beside it (``llamacpp_bench``, ``openvino_bench``).

Decoding one token reads every weight of the decode graph once (the
embedding table only one row, unless it is also the classifier), so
``read bandwidth / weight bytes per token`` is the speed no decoder can beat
on this machine; ``roofline_fraction`` says how much of it we reach. A
prompt chunk is compute: its integer-path matmuls' int8 operations against
the measured peak of the int8 unit they run on (AMX tiles or VNNI) give
``prefill_int8_fraction``.

Both probes share the machine with other tenants (and a 300 MiB L3 on the
machines measured), so each is measured right before each run of the
workload it judges (probe, run, probe, run ...): the fractions are medians
of those pairs, and the spreads say how much the neighbours moved them.
"""
from __future__ import annotations

import os
import resource
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from compiler.driver import LoadedModel, load_model, model_graph
from ir.types import DEFAULT_KV_TYPE

from ..errors import RunError
from ..model import Model


def weight_bytes_per_token(loaded: LoadedModel) -> int:
    """Stored bytes of every weight the decode graph reads for one token. A
    table read only through ``embedding`` costs one row; one that a matmul
    also reads (a tied classifier) costs all of it."""
    g = model_graph(loaded, "decode")
    users = g.users()
    total = 0
    for v in g.weights.values():
        ops = {n.op for n in users.get(id(v), [])}
        if not ops:
            continue
        nbytes = int(v.ref.nbytes)
        if ops == {"embedding"}:
            nbytes //= int(v.type.shape[0])
        total += nbytes
    return total


def int8_ops(loaded: LoadedModel) -> tuple[int, int]:
    """Int8 operations (2 per multiply-add) of the prefill graph's matmuls
    that take the integer path: (per prompt token, once per prompt: the
    classifier on the last token). (0, 0) where this host has no int8 unit."""
    from compiler.codegen.target import host_target
    from ir.quant import QUANT_TYPES

    if not host_target().int_dot:
        return 0, 0
    per_token = once = 0
    for n in model_graph(loaded, "prefill").nodes:
        if n.op not in ("qmatmul", "qmatmul_rows", "qmatmul_add"):
            continue
        x, w = n.inputs[:2]
        qt = QUANT_TYPES.get(w.type.layout or "")
        if qt is None or qt.act is None:
            continue
        ops = 2 * int(w.type.shape[0]) * int(w.type.shape[1])
        if len(x.type.shape) > 1:
            per_token += ops
        else:
            once += ops
    return per_token, once


def spread(values: list[float]) -> list[float]:
    """[min, max] of a probe's or a ratio's values over the runs."""
    return [min(values), max(values)]


def clip_lengths(ctx: int, prompt_tokens: int, gen_tokens: int) -> tuple[int, int]:
    """Prompt and generation lengths that fit the context (generation first)."""
    gen = max(1, min(gen_tokens, ctx - 1))
    prompt = max(1, min(prompt_tokens, ctx - gen))
    return prompt, gen


def median_time(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


#: rounds of the verify-cost measurement (one decode step, then one verify call of each size, a round)
VERIFY_ROUNDS = 15


def verify_cost(ex: Any, ids: list[int], draft_max: int, rounds: int = VERIFY_ROUNDS) -> dict[str, Any]:
    """What a speculative check costs in decode steps: after a prefill of ``ids``,
    decode steps and verify calls of 2, 4, 8 ... rows (up to the draft's
    largest, draft_max + 1, or the chunk) at the same position, taking turns
    so that neighbours on the machine weigh on both alike; medians. The
    acceptance line of issue 30 (8 rows <= 1.3 steps) reads this."""
    ex.reset()
    ex.prefill(ids, 0)
    pos = len(ids)
    room = min(getattr(ex, "chunk", draft_max + 1), ex.ctx - pos, len(ids), draft_max + 1)
    sizes = sorted({r for r in (2, 4, 8, 16, draft_max + 1) if 2 <= r <= room})
    steps: list[float] = []
    calls: dict[int, list[float]] = {r: [] for r in sizes}
    for _ in range(rounds):
        t = time.perf_counter()
        ex.decode(ids[-1], pos)
        steps.append(time.perf_counter() - t)
        for r in sizes:
            t = time.perf_counter()
            ex.verify(ids[-r:], pos)
            calls[r].append(time.perf_counter() - t)
    step = statistics.median(steps)
    return {"decode_step_ms": 1000 * step,
            "verify_cost_steps": {str(r): statistics.median(v) / step for r, v in calls.items()}}


def random_ids(vocab: int, n: int, seed: int) -> list[int]:
    """n random prompt ids past the first three (the control tokens of llama2.c vocabularies)."""
    return [int(i) for i in np.random.default_rng(seed).integers(3, vocab, n)]


def greedy_run(model: Model, ids: list[int], gen: int) -> tuple[list[int], Any]:
    """The prompt ``ids``, then ``gen`` greedy decode steps past the first
    token (no stop): the tokens and the run's ``GenerationStats``."""
    got = list(model.generate(ids, gen + 1, temperature=0.0, stop=False))
    st = model.last_stats
    if len(got) != gen + 1 or st.decode_s <= 0 or st.prefill_s <= 0:
        raise RuntimeError(f"generation stopped after {len(got)} of {gen + 1} tokens")
    return got, st


def long_context(model: Model, short_ids: list[int], long_ids: list[int], gen: int, runs: int) -> dict[str, Any]:
    """What a long prompt costs prefill and the decode after it: greedy
    generations after the short prompt and after the long one, in turns
    (the order swapped every run, so that neighbours on the machine weigh
    on both alike); per pair the long prompt's rates over the short one's,
    medians and spreads of those ratios (``long_*_fraction``)."""
    model.speculation = None
    rates: dict[int, list[tuple[float, float]]] = {0: [], 1: []}   # (prefill, decode) tok/s: short, long
    for i in range(runs):
        for which in (0, 1) if i % 2 == 0 else (1, 0):
            ids = (short_ids, long_ids)[which]
            _, st = greedy_run(model, ids, gen)
            rates[which].append((len(ids) / st.prefill_s, gen / st.decode_s))
    pre = [lg[0] / sh[0] for lg, sh in zip(rates[1], rates[0])]
    dec = [lg[1] / sh[1] for lg, sh in zip(rates[1], rates[0])]
    return {"long_prompt_tokens": len(long_ids),
            "long_prefill_tok_s": statistics.median(r[0] for r in rates[1]),
            "long_decode_tok_s": statistics.median(r[1] for r in rates[1]),
            "long_prefill_fraction": statistics.median(pre), "long_prefill_fraction_spread": spread(pre),
            "long_decode_fraction": statistics.median(dec), "long_decode_fraction_spread": spread(dec)}


def run_bench(model_path: str, tokenizer: str | None, threads: int, prompt_tokens: int = 128,
              gen_tokens: int = 128, runs: int = 5, backend: str = "llvm", probe_bytes: int = 1 << 30,
              probe_repeats: int = 5, seed: int = 0, kv_type: str | None = None,
              mem_budget: int | None = None, stream: str | None = None,
              stream_io: str = "pread", speculation=None, prompt_text: str | None = None,
              constraint=None, long_prompt: int | None = None) -> dict[str, Any]:
    """Measure one model; see the module docstring. Compilation uses a fresh
    temporary cache (the user's cache is neither read nor written). With
    ``backend="interp"`` there is nothing to compile and the compile fields
    are None. ``speculation`` (``runtime.speculative.Speculation``): also
    decode speculatively, each run right after a plain one on the same
    model, and report the drafts, the acceptance and the speed-up (decode
    and sampling time of both: a verify step's choice of tokens is
    sampling). ``prompt_text``: the prompt (control tokens recognised)
    instead of random ids; prompt lookup needs a real one. ``constraint``
    (``runtime.grammar``): also decode under it, each run right after a
    plain one, and report both loops' tokens per second (decode and
    sampling: the mask is computed and applied in sampling) and their ratio.
    ``long_prompt``: also generate after that many random prompt ids, in
    turns with the prompt (``long_context``)."""
    from compiler.codegen.probe import ReadProbe, int8_unit, measure_int8_peak
    from compiler.codegen.target import amx_status

    if threads < 1:
        raise RunError(f"--threads {threads}: must be >= 1")
    if runs < 1:
        raise RunError(f"--runs {runs}: must be >= 1")
    if prompt_tokens < 1 or gen_tokens < 1 or (long_prompt is not None and long_prompt < 1):
        raise RunError("the prompt and the generation need at least one token each")
    from compiler.codegen.target import cpu_model, host_target

    loaded = load_model(model_path, tokenizer)
    out: dict[str, Any] = {"model": os.path.basename(os.fspath(model_path)), "backend": backend,
                           "threads": threads, "cpu_model": cpu_model()}

    old_cache = os.environ.get("LMC_CACHE_DIR")
    cache = tempfile.mkdtemp(prefix="lmc-bench-cache-")
    os.environ["LMC_CACHE_DIR"] = cache
    model = None
    try:
        out["cpu"] = host_target().cpu     # (detected once into the bench's own cache, not the user's)
        if backend == "llvm":
            from compiler.native import NativeOptions, compile_native

            # cold: an empty cache, so LLVM runs (and the artifact is stored, as
            # on a user's first run); warm: the same call, now a cache hit
            opts = NativeOptions(kv_type=kv_type or DEFAULT_KV_TYPE, mem_budget=mem_budget, stream=stream, threads=threads,
                                 stream_io=stream_io, verify=speculation is not None,
                                 auto_ctx=mem_budget is not None, auto_kv=mem_budget is not None and not kv_type)
            cold = compile_native(loaded, opts)
            if cold.cached:
                raise RuntimeError("the bench's fresh compile cache was not empty")
            warm = compile_native(loaded, opts)
            if not warm.cached:
                raise RuntimeError("the second compile missed the cache it had just filled")
            out["compile_s_cold"] = cold.seconds
            out["compile_s_warm"] = warm.seconds
            model = Model(loaded, "llvm", threads=threads, artifact=warm.artifact, speculation=speculation)
        else:
            out["compile_s_cold"] = out["compile_s_warm"] = None
            model = Model(loaded, backend, threads=threads, kv_type=kv_type, speculation=speculation)

        out["kv_type"], out["kv_bytes"] = model.kv_type, model.kv_bytes
        if backend == "llvm":   # a prompt row's attention: per row, or AMX bf16 tiles from a position on
            from compiler.driver import FROM_POSITION, attention_tiles
            t = host_target()
            tiles = attention_tiles() and t.amx and t.has("amx-bf16") and model.kv_type == "f16"
            out["prompt_attention"] = f"tiles from position {FROM_POSITION}" if tiles else "rows"
        if prompt_text is not None:
            ids = model.encode(prompt_text, bos=True, special=True)
            if len(ids) + gen_tokens > model.ctx:
                raise RunError(f"the prompt ({len(ids)} tokens) and {gen_tokens} new ones exceed the context "
                               f"({model.ctx})")
            prompt, gen = len(ids), gen_tokens
        else:
            prompt, gen = clip_lengths(model.ctx, prompt_tokens, gen_tokens)
            ids = random_ids(loaded.config.vocab_size, prompt, seed)
        out["prompt_tokens"], out["gen_tokens"], out["runs"] = prompt, gen, runs
        if long_prompt is not None and long_prompt + gen > model.ctx:
            raise RunError(f"--long-prompt {long_prompt}: with {gen} generated tokens it exceeds the context "
                           f"({model.ctx})")
        ex = model.executor

        def prefill() -> None:
            ex.reset()
            ex.prefill(ids, 0)

        prefill()  # warm-up: first-touch of weights and arena
        unit = int8_unit() if backend == "llvm" else None
        out["int8_unit"] = unit
        out["amx"] = amx_status()
        prefill_s, peaks = [], []
        for _ in range(runs):   # probe, run, probe, run: each run judged by the peak right before it
            if unit:
                peaks.append(measure_int8_peak(threads))
            prefill_s.append(median_time(prefill, 1))
        out["prefill_tok_s"] = prompt / statistics.median(prefill_s)
        per_token, once = int8_ops(loaded) if unit else (0, 0)
        if per_token:
            ops = per_token * prompt + once
            out["int8_peak_gops"] = statistics.median(peaks)
            out["int8_peak_spread_gops"] = spread(peaks)
            out["prefill_int8_gops"] = ops / statistics.median(prefill_s) / 1e9
            fr = [ops / t / 1e9 / pk for t, pk in zip(prefill_s, peaks)]
            out["prefill_int8_fraction"] = statistics.median(fr)
            out["prefill_int8_fraction_spread"] = spread(fr)

        decode_s, io_split, plain_loop, spec_loop, spec_stats = [], [], [], [], []
        constrained, mask_s, pair_ratio = [], [], []
        identical = True
        # the model's own peak, before the bandwidth probe's buffer (probe_bytes) joins it
        model.speculation = None
        list(model.generate(ids, 2, temperature=0.0, stop=False))
        out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        probe = ReadProbe(threads, probe_bytes)
        bws = []

        def constrained_run() -> float | None:
            n_c = len(list(model.generate(ids, gen + 1, temperature=0.0, stop=False, grammar=constraint)))
            st = model.last_stats
            if n_c < 2:
                return None
            # tokens after the first, each a decode step and a masked choice
            constrained.append((n_c - 1) / (st.decode_s + st.sample_s))
            mask_s.append(st.sample_s / n_c)
            return constrained[-1]

        for i in range(runs):
            bws.append(probe.measure(probe_repeats))
            model.speculation = None
            # the probe has just pushed the weights out of the caches: the plain
            # and the constrained runs take turns at being first after it
            rate = constrained_run() if constraint is not None and i % 2 else None
            got, st = greedy_run(model, ids, gen)
            decode_s.append(st.decode_s)  # exactly `gen` decode steps, sampling excluded
            plain_loop.append(st.decode_s + st.sample_s)
            if "decode_io_wait_s" in st.extra:
                io_split.append((st.extra["decode_io_wait_s"], st.extra["read_bytes"], st.extra["read_s"]))
            if constraint is not None and not i % 2:
                rate = constrained_run()
            if rate is not None:
                pair_ratio.append(rate / (gen / plain_loop[-1]))
            if speculation is not None:
                model.speculation = speculation
                spec = list(model.generate(ids, gen + 1, temperature=0.0, stop=False))
                identical = identical and spec == got
                st = model.last_stats
                spec_loop.append(st.decode_s + st.sample_s)
                spec_stats.append(st.extra)
        out["decode_tok_s"] = gen / statistics.median(decode_s)
        if long_prompt is not None:
            out.update(long_context(model, ids, random_ids(loaded.config.vocab_size, long_prompt, seed + 1), gen, runs))
        if constraint is not None:
            if not constrained:
                raise RunError("the constrained generation ended after its first token: give a prompt "
                               "(--prompt-text) that starts an answer")
            out["plain_loop_tok_s"] = gen / statistics.median(plain_loop)
            out["constrained_loop_tok_s"] = statistics.median(constrained)
            out["constrained_vs_plain"] = statistics.median(pair_ratio) if pair_ratio else None
            out["constrained_sample_ms_per_token"] = 1000 * statistics.median(mask_s)
            out["constraint"] = constraint.kind
        if speculation is not None:
            last = spec_stats[-1]
            out["speculative"] = f"{speculation.kind} (draft-max {speculation.draft_max})"
            out["plain_loop_tok_s"] = gen / statistics.median(plain_loop)
            out["speculative_loop_tok_s"] = gen / statistics.median(spec_loop)
            out["speculative_speedup"] = statistics.median(plain_loop) / statistics.median(spec_loop)
            out["drafted"], out["accepted"] = last["drafted"], last["accepted"]
            out["acceptance_rate"] = last["acceptance_rate"]
            out["verify_steps"] = last["verify_steps"]
            out["speculative_identical"] = identical
            out.update(verify_cost(ex, ids, speculation.draft_max, VERIFY_ROUNDS if backend == "llvm" else 3))
        mem = (model.executor.manifest.get("memory") or {}) if hasattr(model.executor, "manifest") else {}
        if mem:
            out["memory_plan"] = {"describe": mem["describe"], "total": mem["total"], "budget": mem["budget"]}
        if io_split:  # streaming: where the decode time went (medians over the runs)
            wait = statistics.median(w for w, _, _ in io_split)
            dmed = statistics.median(decode_s)
            out["decode_io_wait_s"], out["decode_compute_s"] = wait, dmed - wait
            out["io_wait_fraction"] = wait / dmed
            out["disk_read_gb_s"] = statistics.median(b / r for _, b, r in io_split if r > 0) / 1e9
        del probe
    finally:
        if model is not None and hasattr(model.executor, "close"):
            model.executor.close()  # idle workers must not compete with the probe
        del model
        if old_cache is None:
            os.environ.pop("LMC_CACHE_DIR", None)
        else:
            os.environ["LMC_CACHE_DIR"] = old_cache
        shutil.rmtree(cache, ignore_errors=True)

    wbytes = weight_bytes_per_token(loaded)
    out["weight_bytes_per_token"] = wbytes
    out["vocab_size"] = loaded.config.vocab_size
    out["read_bandwidth_gb_s"] = statistics.median(bws)
    out["read_bandwidth_spread_gb_s"] = spread(bws)
    out["roofline_tok_s"] = out["read_bandwidth_gb_s"] * 1e9 / wbytes
    fr = [gen / d / (bw * 1e9 / wbytes) for d, bw in zip(decode_s, bws)]
    out["roofline_fraction"] = statistics.median(fr)
    out["roofline_fraction_spread"] = spread(fr)
    return out


def compare_with(r: dict[str, Any], peer: str, model_path: str, threads: int, runs: int,
                 prompt_text: str | None = None, json_schema: dict[str, Any] | None = None) -> None:
    """Add a peer's figures on the same file (``r[peer]``, or its error) and
    our ratios to them (``decode_vs_<peer>``, ``prefill_vs_<peer>``) to a
    ``run_bench`` result. ``peer``: ``llamacpp`` (the xllamacpp package) or
    ``openvino`` (OpenVINO GenAI), each run in a child process. llama.cpp
    also takes our prompt text and JSON schema (``constrained_vs_llamacpp``:
    our decode loop under the schema against its own). With a long prompt
    (``long_context``), the peer also runs on random ids of its length, in
    a second child after the first (its ``long_*`` figures)."""
    vocab = int(r.get("vocab_size") or 32000)
    if peer == "llamacpp":
        from .llamacpp_bench import bench_llamacpp as bench

        got = bench(model_path, threads, r["prompt_tokens"], r["gen_tokens"], runs, vocab, prompt_text=prompt_text,
                    json_schema=json_schema)
    elif peer == "openvino":
        from .openvino_bench import bench_openvino as bench

        got = bench(model_path, threads, r["prompt_tokens"], r["gen_tokens"], runs, vocab)
    else:
        raise ValueError(f"unknown peer {peer!r}")
    if "error" not in got and r.get("long_prompt_tokens"):   # random ids of the long prompt's length, after
        long = bench(model_path, threads, r["long_prompt_tokens"], r["gen_tokens"], runs, vocab)
        if "error" in long:
            got["long_error"] = long["error"]
        else:
            got["long_prefill_tok_s"], got["long_decode_tok_s"] = long["prefill_tok_s"], long["decode_tok_s"]
            got["long_prefill_fraction"] = long["prefill_tok_s"] / got["prefill_tok_s"]
            got["long_decode_fraction"] = long["decode_tok_s"] / got["decode_tok_s"]
    r[peer] = got
    if "error" not in got:
        r[f"decode_vs_{peer}"] = r["decode_tok_s"] / got["decode_tok_s"]
        r[f"prefill_vs_{peer}"] = r["prefill_tok_s"] / got["prefill_tok_s"]
        if "constrained_decode_tok_s" in got and r.get("constrained_loop_tok_s"):
            r[f"constrained_vs_{peer}"] = r["constrained_loop_tok_s"] / got["constrained_decode_tok_s"]
