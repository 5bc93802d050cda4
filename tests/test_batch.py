"""Continuous batching: the paged batch graphs end to end.

A toy block manager hands out pool blocks in shuffled order, so a
sequence's blocks are scattered and sequences interleave in the pool. The
same schedule (prompts whole and in chunks, decode rounds of every active
sequence, a mixed step with a decode row and a chunk, sequences joining
late) runs on the interpreter's and the native batch entries; every row's
logits must equal that sequence run alone through today's single-stream
graphs. Models: stories260K (f32 and f16 KV), and synthetic Qwen- and
Gemma-3-shaped GGUFs (head_dim 64, so q8 KV too; Gemma's sliding window of
5 is shorter than the sequences, and its sixth layer is global).

Decode rows (``batch(..., decode=True)``) on models whose decode step takes
the integer path (``int_dot``: Q8_0, Q4_0, Q5_0, Q4_1, Q5_1 weights, and the
K-quants Q4_K, Q5_K, Q6_K on rows of whole super-blocks) run through
``batch_decode`` and must equal each sequence's own decode step bit for bit:
synthetic Q8_0, Q4_0, Q5_0/Q4_K and Gemma-3-shaped Q4_K GGUFs, and
SmolLM2-135M-Instruct when ../shared can provide it.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import runtime
from compiler.driver import BatchOptions, CompileOptions, build_graphs, load_model
from compiler.codegen.target import host_target, vnni_width
from compiler.native import NativeOptions, compile_native
from frontends.arch import ModelConfig, expected_shapes
from frontends.gguf_writer import write_gguf
from ir.dot import to_dot
from ir.printer import print_graph
from llamacpp_oracle import printable_vocab, random_tensor
from runtime.cli import DEFAULT_MODEL, DEFAULT_TOKENIZER
from runtime.engine import load_batch_model
from runtime.executor import InterpExecutor
from runtime.native import NativeExecutor
from runtime.paged import BatchError, BatchIndexError
from shared_data import SMOLLM2, instruct_models

CTX = 64
BS = 4
NB = 48
VOCAB = 320
BATCH = BatchOptions(block_size=BS, n_blocks=NB, max_batch=4)

SYNTH = {
    "qwen2": dict(arch="qwen2", dim=256, hidden_dim=512, n_layers=2, n_heads=4, n_kv_heads=2, tied_output=False),
    "gemma3": dict(arch="gemma3", dim=256, hidden_dim=512, n_layers=6, n_heads=4, n_kv_heads=1, tied_output=False,
                   rope_theta=1e6, extra={"sliding_window": 5, "rope_local_theta": 10000.0}),
    # 320-wide rows: Q4_K falls back to Q5_0 there, as llama.cpp's quantizer does (Qwen2.5-Coder's
    # Q4_K_M layers), next to ffn_down's Q4_K rows of 512 (the K-quants' integer path)
    "qwen2_320": dict(arch="qwen2", dim=320, hidden_dim=512, n_layers=2, n_heads=5, n_kv_heads=1, tied_output=False),
}
#: models whose decode takes the integer path, by name: (SYNTH config, qtype asked for)
INT_MODELS = {"q8_0": ("qwen2", "Q8_0"), "q4_0": ("qwen2", "Q4_0"), "q5_0": ("qwen2_320", "Q4_K"),
              "q4_k": ("gemma3", "Q4_K")}
#: the pipeline with int_dot, on any host (without VNNI the kernel's portable path)
INT_PASSES = ("fuse_dequant", "int_dot")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Model files by name: stories260K and the synthetic GGUFs (qwen2 F32
    and gemma3 Q4_K weights, compared with the interpreter on the float
    path; the INT_MODELS on the integer path, see int_dot)."""
    out = {"stories": (str(DEFAULT_MODEL), str(DEFAULT_TOKENIZER))}
    for name, (arch, qtype) in {"qwen2": ("qwen2", "F32"), "gemma3": ("gemma3", "Q4_K"), **INT_MODELS}.items():
        cfg = ModelConfig(**SYNTH[arch], vocab_size=VOCAB, seq_len=CTX)
        p = tmp_path_factory.mktemp("batch") / f"{name}.gguf"
        write_gguf(p, cfg, random_tensor(expected_shapes(cfg), 3), qtype, vocab=printable_vocab(VOCAB))
        out[name] = (str(p), None)
    return out


_MODELS: dict = {}


def loaded(paths, name: str):
    if name not in _MODELS:
        _MODELS[name] = load_model(*paths[name])
    return _MODELS[name]


def interp_single(paths, name: str, kv: str) -> InterpExecutor:
    return InterpExecutor(build_graphs(loaded(paths, name), CompileOptions(ctx=CTX, kv_type=kv)))


def interp_batch(paths, name: str, kv: str, batch: BatchOptions = BATCH, max_rows: int = 16,
                 passes: tuple[str, ...] | None = None) -> InterpExecutor:
    return InterpExecutor(build_graphs(loaded(paths, name), CompileOptions(ctx=CTX, kv_type=kv, batch=batch,
                                                                          passes=passes)),
                          max_rows=max_rows)


def native(paths, name: str, kv: str, batch: BatchOptions | None = BATCH, chunk: int = 16,
           threads: int = 2, passes: tuple[str, ...] | None = None) -> NativeExecutor:
    m = loaded(paths, name)
    art = compile_native(m, NativeOptions(ctx=CTX, kv_type=kv, batch=batch, prefill_chunk=chunk,
                                          passes=passes)).artifact
    return NativeExecutor(art, m.path, threads=threads)


# --- a toy scheduler ------------------------------------------------------------------
class Blocks:
    """Free pool blocks in shuffled order: a sequence's blocks scatter and
    sequences interleave in the pool."""

    def __init__(self, n_blocks: int, seed: int, block_size: int = BS) -> None:
        self.free = [int(b) for b in np.random.default_rng(seed).permutation(n_blocks)]
        self.size = block_size

    def take(self) -> int:
        return self.free.pop()


@dataclasses.dataclass
class Seq:
    ids: list[int]
    table: list[int]

    def grow(self, blocks: Blocks, length: int) -> None:
        while len(self.table) * blocks.size < length:
            self.table.append(blocks.take())


class Schedule:
    """Drives an executor's ``batch`` and records every row's logits by
    (sequence, position)."""

    def __init__(self, ex, seed: int = 0) -> None:
        self.ex = ex
        self.blocks = Blocks(ex.n_blocks, seed, ex.block_size)
        self.seqs: list[Seq] = []
        self.rows: dict[tuple[int, int], np.ndarray] = {}

    def new(self) -> int:
        self.seqs.append(Seq([], []))
        return len(self.seqs) - 1

    def step(self, work: list[tuple[int, list[int]]], last_only: bool = False, decode: bool = False) -> np.ndarray:
        """One batch step: for each (sequence, new tokens), its rows, in order
        (its inputs kept in ``last``)."""
        toks, pos, tabs, keys = [], [], [], []
        for s, new in work:
            seq = self.seqs[s]
            seq.grow(self.blocks, len(seq.ids) + len(new))
            for t in new:
                toks.append(t)
                pos.append(len(seq.ids))
                keys.append((s, len(seq.ids)))
                seq.ids.append(t)
        width = max(len(self.seqs[s].table) for s, _ in work)
        for s, new in work:
            tabs += [self.seqs[s].table + [0] * (width - len(self.seqs[s].table))] * len(new)
        self.last = (toks, pos, tabs)
        out = self.ex.batch(toks, pos, tabs, last_only=last_only, decode=decode)
        if last_only:
            self.rows[keys[-1]] = out
        else:
            self.rows.update(zip(keys, out))
        return out


def run_schedule(ex, seed: int = 0) -> Schedule:
    """Prompts whole, in chunks and as an all-rows step; decode rounds; a
    mixed step (decode rows and a chunk, shuffled); a late sequence."""
    rng = np.random.default_rng(seed)
    vocab = ex.pool.vocab
    sch = Schedule(ex, seed)
    tok = lambda n: [int(t) for t in rng.integers(3, vocab, n)]  # noqa: E731
    a, b, c, d = (sch.new() for _ in range(4))
    sch.step([(a, tok(5))], last_only=True)
    sch.step([(b, tok(8))], last_only=True)
    sch.step([(b, tok(5))], last_only=True)     # a second chunk of b's prompt
    sch.step([(c, tok(1))], last_only=True)
    sch.step([(d, tok(9))])                     # every row of d's prompt
    for _ in range(4):
        sch.step([(s, tok(1)) for s in (a, b, c, d)])
    work = [(a, tok(1)), (b, tok(3)), (c, tok(1))]
    toks, pos, tabs, keys = [], [], [], []
    for s, new in work:   # the mixed step, rows shuffled: one sequence's rows still see each other
        seq = sch.seqs[s]
        seq.grow(sch.blocks, len(seq.ids) + len(new))
        for t in new:
            toks.append(t)
            pos.append(len(seq.ids))
            tabs.append(seq.table + [0] * (ex.max_blocks_per_seq - len(seq.table)))
            keys.append((s, len(seq.ids)))
            seq.ids.append(t)
    order = rng.permutation(len(toks))
    out = ex.batch([toks[i] for i in order], [pos[i] for i in order], [tabs[i] for i in order])
    sch.rows.update({keys[i]: out[j] for j, i in enumerate(order)})
    e = sch.new()                               # joins late
    sch.step([(e, tok(6))], last_only=True)
    for _ in range(3):
        sch.step([(s, tok(1)) for s in (a, b, c, d, e)])
    return sch


def close(got, want, rel: float) -> None:
    scale = max(1.0, float(np.abs(want).max()))
    assert np.abs(np.asarray(got) - np.asarray(want)).max() <= rel * scale


CASES = [("stories", "f32"), ("stories", "f16"), ("qwen2", "f32"), ("qwen2", "q8"), ("gemma3", "f16"),
         ("gemma3", "q8")]


# --- the interpreter: batch graph == each sequence alone ----------------------------------
#: how far a row may be from the single stream's: f32 to float rounding; an
#: f16 or q8 cache rounds K/V, so the last-bit differences between matmuls
#: over different row counts (numpy's BLAS) now and then flip a rounding of
#: a stored value by one f16 ulp or one q8 step
TOLERANCE = {"f32": 2e-5, "f16": 2e-4, "q8": 5e-3}


@pytest.mark.parametrize("name,kv", CASES)
def test_interp_batch_equals_single_streams(paths, name, kv):
    sch = run_schedule(interp_batch(paths, name, kv))
    single = interp_single(paths, name, kv)
    for s, seq in enumerate(sch.seqs):
        single.reset()
        want = single.prefill(seq.ids, 0, all_logits=True)
        for (r, p), got in sch.rows.items():
            if r == s:
                close(got, want[p], TOLERANCE[kv])
    assert len(sch.rows) > 40
    # the decode graph agrees too, on the last token of each sequence
    for s, seq in enumerate(sch.seqs):
        single.reset()
        single.prefill(seq.ids[:-1], 0)
        close(sch.rows[(s, len(seq.ids) - 1)], single.decode(seq.ids[-1], len(seq.ids) - 1), TOLERANCE[kv])


@pytest.mark.parametrize("name,kv", CASES)
def test_interp_one_sequence_as_one_step_is_prefill(paths, name, kv):
    """The same rows in the same order as prefill_all, through a scattered
    block table: the same numbers, to the last bit."""
    ids = [int(t) for t in np.random.default_rng(8).integers(3, loaded(paths, name).config.vocab_size, 23)]
    single = interp_single(paths, name, kv)
    want = single.prefill(ids, 0, all_logits=True)
    table = [int(b) for b in np.random.default_rng(9).permutation(NB)[:6]]
    got = interp_batch(paths, name, kv, max_rows=None).batch(ids, range(23), [table] * 23)
    np.testing.assert_array_equal(got, want)


# --- native batch entries == the interpreter's ------------------------------------------------
@pytest.mark.parametrize("name,kv", CASES)
def test_native_batch_equals_interpreter(paths, name, kv):
    """The float kernels against the interpreter, the same pipeline on both
    sides (the integer path rounds activations to 8 bits: its batches are
    checked against its own decode steps below)."""
    from compiler.pipeline import DEFAULT_PIPELINE

    want = run_schedule(interp_batch(paths, name, kv, passes=DEFAULT_PIPELINE)).rows
    got = run_schedule(native(paths, name, kv, passes=DEFAULT_PIPELINE)).rows
    assert want.keys() == got.keys()
    # q8 KV rounds each K/V row to 8 bits: a last-bit difference in a value
    # (native tanh/exp against numpy's) can move it one int8 step, about 1e-3
    # of the logits' scale on gemma3 (its f16-KV case agrees to 2e-4)
    for k in want:
        close(got[k], want[k], 2e-3 if kv == "q8" else 2e-4)


# --- native greedy: B sequences batched == each decoded alone ------------------------------------
def greedy_batched(ex, prompts: list[list[int]], steps: int, join: list[int],
                   decode: bool = False) -> list[list[int]]:
    """Greedy continuation of every prompt; prompt i joins at round join[i];
    ``decode``: the rounds' rows as decode rows (``batch_decode``)."""
    sch = Schedule(ex, 5)
    ids = [sch.new() for _ in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    for rnd in range(max(join) + steps):
        for i, p in enumerate(prompts):
            if join[i] == rnd:
                out[i].append(int(np.argmax(sch.step([(ids[i], p)], last_only=True))))
        live = [i for i in range(len(prompts)) if join[i] < rnd and len(out[i]) < steps]
        if live:
            rows = sch.step([(ids[i], [out[i][-1]]) for i in live], decode=decode)
            for i, row in zip(live, rows):
                out[i].append(int(np.argmax(row)))
    return out


@pytest.mark.parametrize("name", ["stories", "qwen2", "gemma3"])
def test_native_batch_greedy_equals_single_decode(paths, name):
    """Sequences join at different rounds; each row's greedy token is the
    single stream's. (On weights the single-stream decode runs through the
    integer path, with VNNI, prompt chunks take the float tiles or the
    integer GEMM, which round differently, and greedy runs can part at near
    ties: decode rows go through batch_decode then, as the scheduler sends
    them, see test_native_decode_rows_greedy_equals_generate.)"""
    rng = np.random.default_rng(2)
    vocab = loaded(paths, name).config.vocab_size
    prompts = [[1] + [int(t) for t in rng.integers(3, vocab, n)] for n in (4, 11, 1, 7)]
    steps = 32 if name == "stories" else 24   # the synthetic models' context is 64
    ex = native(paths, name, "f32")
    got = greedy_batched(ex, prompts, steps, join=[0, 0, 3, 9], decode="batch_decode" in ex.entries)
    single = runtime.load(paths[name][0], paths[name][1], ctx=CTX, threads=2, kv_type="f32")   # the pool's
    for p, g in zip(prompts, got):
        assert g == list(single.generate(p, steps, temperature=0.0, stop=False))
        assert len(set(g)) > steps // 4   # a model that repeats one token would compare nothing


# --- decode rows on the integer path: batch_decode == each sequence's decode step ----------------
def singles_and_batch(paths, name: str, backend: str):
    """(the batch executor, a maker of single-stream executors) with int_dot."""
    m = loaded(paths, name)
    if backend == "interp":
        graphs = build_graphs(m, CompileOptions(ctx=CTX, passes=INT_PASSES, kv_type="f32"))
        ex = interp_batch(paths, name, "f32", passes=INT_PASSES)
        assert "batch_decode" in ex.graphs
        return ex, lambda: InterpExecutor(graphs)
    art = compile_native(m, NativeOptions(ctx=CTX, passes=INT_PASSES, kv_type="f32")).artifact
    ex = native(paths, name, "f32", passes=INT_PASSES)
    assert "batch_decode" in ex.entries
    return ex, lambda: NativeExecutor(art, m.path, threads=2)


def check_decode_rows(ex, singles: list, prompts: list[list[int]], rounds: int, rng,
                      prompt_rows_equal: bool = False) -> None:
    """For B = 1 .. len(singles) sequences (prompts of different lengths,
    so rows sit at different positions; prompts through ``batch_last`` and
    ``prefill``): ``rounds`` steps of B decode rows, each row equal, bit for
    bit, to that sequence's own decode step. Where every matmul of ``batch``
    takes the integer path with decode's arithmetic (no GEMM), or in the
    interpreter, whose float matmuls do not depend on tiling
    (``prompt_rows_equal``), the last step once more as prompt-chunk rows
    gives the decode rows too; otherwise each prompt-chunk row is at least
    the one that row alone gives (chunk invariance). And again as decode
    rows, which rewrite the same K/V rows and give the same logits."""
    vocab = ex.pool.vocab
    for B in range(1, len(singles) + 1):
        sch = Schedule(ex, B)
        for i in range(B):
            sch.step([(sch.new(), prompts[i])], last_only=True)
            singles[i].prefill(prompts[i], 0)
        for _ in range(rounds):
            new = [int(t) for t in rng.integers(3, vocab, B)]
            rows = sch.step([(i, [t]) for i, t in enumerate(new)], decode=True)
            for i, t in enumerate(new):
                np.testing.assert_array_equal(rows[i], singles[i].decode(t, len(sch.seqs[i].ids) - 1))
        if prompt_rows_equal:
            np.testing.assert_array_equal(ex.batch(*sch.last), rows)
        else:
            chunk = ex.batch(*sch.last)
            for i in range(B):
                alone = ex.batch(*([a[i]] for a in sch.last))
                np.testing.assert_array_equal(alone[0], chunk[i])
        np.testing.assert_array_equal(ex.batch(*sch.last, decode=True), rows)


@pytest.mark.parametrize("backend", ["interp", "llvm"])
@pytest.mark.parametrize("name", list(INT_MODELS))
def test_decode_rows_equal_decode_steps(paths, name, backend):
    ex, single = singles_and_batch(paths, name, backend)
    rng = np.random.default_rng(6)
    prompts = [[int(t) for t in rng.integers(3, VOCAB, n)] for n in (3, 9, 1, 6)]
    batch = build_graphs(loaded(paths, name), CompileOptions(ctx=CTX, passes=INT_PASSES, batch=BATCH))["batch"]
    all_int = all(n.attrs.get("act") in ("q8", "q8k") for n in batch.nodes if n.op in ("matmul", "qmatmul"))
    # prompt chunks on a VNNI host: the integer GEMM, not decode's bits
    no_gemm = vnni_width(host_target().vector_width) is None
    # the interpreter's float matmuls are float64 sums, whatever the tiling: equal there too
    check_decode_rows(ex, [single() for _ in range(BATCH.max_batch)], prompts, 3, rng,
                      prompt_rows_equal=(all_int and no_gemm) or backend == "interp")
    if backend == "llvm":   # the step's inputs and scratch: a quantized row per decode row
        from compiler.codegen.matmul.int_kquants import slot_bytes as kq_slot_bytes
        from compiler.codegen.matmul.int_q8 import slot_bytes

        e, m = ex.entries, ex.manifest
        assert e["batch_decode"]["inputs"] == e["batch"]["inputs"]
        acts = {n.attrs.get("act") for n in batch.nodes}
        dim = loaded(paths, name).config.dim
        slot = max(slot_bytes(dim) if "q8" in acts else 0, kq_slot_bytes(dim) if "q8k" in acts else 0)
        assert m["scratch_floats"] * 4 >= BATCH.max_batch * slot


@pytest.mark.parametrize("name", list(INT_MODELS))
def test_native_decode_rows_greedy_equals_generate(paths, name):
    """As test_native_batch_greedy_equals_single_decode, on the integer
    path: decode rows through batch_decode give each sequence the tokens
    ``generate`` (the single-stream decode step) gives it."""
    rng = np.random.default_rng(2)
    prompts = [[1] + [int(t) for t in rng.integers(3, VOCAB, n)] for n in (4, 11, 1, 7)]
    got = greedy_batched(native(paths, name, "f32", passes=INT_PASSES), prompts, 24, join=[0, 0, 3, 9],
                         decode=True)
    single = runtime.load(paths[name][0], ctx=CTX, threads=2, passes=INT_PASSES, kv_type="f32")
    for p, g in zip(prompts, got):
        assert g == list(single.generate(p, 24, temperature=0.0, stop=False))
        assert len(set(g)) > 6


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct Q4_1 (its Q4_1 matrices and Q8_0 output matrix: the integer path),
    compiled for batches of 4 sequences, and prompts from its tokenizer."""
    path = instruct_models()[SMOLLM2]
    m = load_model(path)
    art = compile_native(m, NativeOptions(ctx=128, passes=INT_PASSES, prefill_chunk=32,
                                          batch=BatchOptions(16, None, 4))).artifact
    texts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
             "def fibonacci(n):\n    "]
    return path, art, [m.tokenizer.encode(t, bos=True) for t in texts]


def test_smollm2_decode_rows_equal_decode_steps(smollm2):
    path, art, prompts = smollm2
    ex = NativeExecutor(art, path, threads=2)
    assert "batch_decode" in ex.entries
    single = compile_native(load_model(path), NativeOptions(ctx=128, passes=INT_PASSES)).artifact
    check_decode_rows(ex, [NativeExecutor(single, path, threads=2) for _ in range(4)], prompts, 2,
                      np.random.default_rng(7))


def test_smollm2_greedy_batched_equals_generate(smollm2):
    """What a server gives 4 clients at once, batched, is what ``lmc run``
    gives each alone: 48 greedy tokens."""
    path, art, prompts = smollm2
    got = greedy_batched(NativeExecutor(art, path, threads=2), prompts, 48, join=[0, 0, 2, 5], decode=True)
    single = runtime.load(path, ctx=128, threads=2, passes=INT_PASSES)
    for p, g in zip(prompts, got):
        assert g == list(single.generate(p, 48, temperature=0.0, stop=False))


# --- copy_block -----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["interp", "llvm"])
def test_copy_block_shares_a_prefix(paths, backend):
    """Sequence B takes A's first block as is and a copy of its second
    (copy on write): at position 8 both see the same history, so the same
    token gives the same logits; without the copy, B's would differ."""
    ex = interp_batch(paths, "stories", "f32") if backend == "interp" else native(paths, "stories", "f32")
    tab_a, tab_b = [5, 9, 2, 0], [5, 30, 31, 0]
    ids = [1, 400, 33, 57, 90, 12, 7, 300]
    ex.batch(ids, range(8), [tab_a] * 8, last_only=True)
    before = ex.batch([77, 77], [8, 8], [tab_a, tab_b])
    assert np.abs(before[0] - before[1]).max() > 1e-3
    ex.copy_block(9, 30)
    after = ex.batch([77, 77], [8, 8], [tab_a, tab_b])
    np.testing.assert_allclose(after[0], after[1], rtol=0, atol=1e-5)
    np.testing.assert_allclose(after[0], before[0], rtol=0, atol=1e-5)
    for bad in ((-1, 3), (0, NB), (1.0, 2)):
        with pytest.raises(BatchIndexError):
            ex.copy_block(*bad)


def test_copy_block_copies_every_layer(paths):
    ex = interp_batch(paths, "stories", "f16")
    for i, buf in enumerate(ex.state.values()):
        buf[...] = np.random.default_rng(i).standard_normal(buf.shape)
    before = {k: v.copy() for k, v in ex.state.items()}
    ex.copy_block(3, 7)
    for k, v in ex.state.items():
        np.testing.assert_array_equal(v[7 * BS: 8 * BS], before[k][3 * BS: 4 * BS])
        v[7 * BS: 8 * BS] = before[k][7 * BS: 8 * BS]
        np.testing.assert_array_equal(v, before[k])


# --- checks before native code runs -----------------------------------------------------------------
@pytest.mark.parametrize("backend", ["interp", "llvm"])
def test_batch_refuses_bad_steps(paths, backend):
    ex = interp_batch(paths, "stories", "f32") if backend == "interp" else native(paths, "stories", "f32")
    assert (ex.block_size, ex.n_blocks, ex.max_blocks_per_seq, ex.max_rows) == (BS, NB, CTX // BS, 16)
    ok = dict(tokens=[1, 2], positions=[0, 5], tables=[[0, 1], [2, 3]])
    assert ex.batch(**ok).shape == (2, 512)
    assert ex.batch(**ok, last_only=True).shape == (512,)
    bad = [
        (dict(ok, tokens=[1, 512]), BatchIndexError, "vocabulary"),
        (dict(ok, tokens=[1, -1]), BatchIndexError, "vocabulary"),
        (dict(ok, positions=[0, CTX]), BatchIndexError, "context"),
        (dict(ok, positions=[-1, 0]), BatchIndexError, "context"),
        (dict(ok, positions=[0, 8]), BatchIndexError, "block 2"),
        (dict(ok, tables=[[0, 1], [2, NB]]), BatchIndexError, "pool"),
        (dict(ok, tables=[[0, 1], [-2, 3]]), BatchIndexError, "pool"),
        (dict(ok, tables=[[0, 1], [0, 1]], positions=[5, 5]), BatchError, "same KV pool row"),
        (dict(ok, positions=[0]), BatchError, "shape"),
        (dict(ok, tables=[0, 1]), BatchError, "shape"),
        (dict(ok, tables=np.zeros((2, CTX // BS + 1), int)), BatchError, "shape"),
        (dict(tokens=[], positions=[], tables=np.zeros((0, 2), int)), BatchError, "non-empty"),
        (dict(ok, tokens=[1.0, 2.0]), BatchError, "integers"),
        (dict(tokens=list(range(17)), positions=list(range(17)), tables=[list(range(5))] * 17), BatchError,
         "rows per step"),
        (dict(tokens=[1] * 5, positions=range(5), tables=[[0, 1]] * 5, decode=True), BatchError,
         "4 sequences per step"),
        (dict(ok, decode=True, last_only=True), BatchError, "last_only"),
    ]
    for kw, err, msg in bad:
        with pytest.raises(err, match=msg):
            ex.batch(**kw)
    # no integer path here (F32 weights): decode rows run as ``batch``
    assert ex.max_batch == 4
    np.testing.assert_array_equal(ex.batch(**ok, decode=True), ex.batch(**ok))
    # unused table entries may hold anything
    assert np.isfinite(ex.batch([1], [0], [[4, -1, 10 ** 9]])).all()
    with pytest.raises(BatchError, match="batched serving"):
        ex.decode(1, 0)
    with pytest.raises(BatchError, match="batched serving"):
        ex.prefill([1], 0)


def test_long_prompt_runs_in_pieces(paths):
    """last_only with more rows than a step takes: pieces of max_rows, the
    same logits as one interpreter step over the whole prompt."""
    nat = native(paths, "stories", "f32", batch=BatchOptions(BS, NB, 4), chunk=8)
    assert nat.max_rows == 8
    ids = [int(t) for t in np.random.default_rng(4).integers(0, 512, 21)]
    tab = [list(range(3, 9))] * 21
    want = interp_batch(paths, "stories", "f32", max_rows=None).batch(ids, range(21), tab, last_only=True)
    close(nat.batch(ids, range(21), tab, last_only=True), want, 2e-4)


# --- compiling, the manifest, the API -------------------------------------------------------------
@pytest.mark.parametrize("backend", ["interp", "llvm"])
@pytest.mark.parametrize("name", ["stories", "q4_k"])
def test_select_gives_the_named_rows_of_batch(paths, name, backend):
    """``batch(..., select=rows)``: those rows' logits, bit for bit the rows
    ``batch`` gives, rows of several sequences at several positions in one
    step; bad selections are refused before native code runs."""
    if backend == "llvm":
        ex = native(paths, name, "f32")
    else:
        ex = interp_batch(paths, name, "f32")
    if not ex.can_select:
        pytest.skip("decode rows need batch_decode here (no VNNI for repacked weights)")
    tok = [5, 9, 31, 7, 64, 2, 11, 40, 3]
    pos = [0, 1, 2, 3, 4, 0, 1, 2, 0]
    tab = [[0, 1, 2, 3]] * 5 + [[4, 5, 6, 7]] * 3 + [[8, 9, 10, 11]]
    full = np.array(ex.batch(tok, pos, tab))
    for sel in ([4], [7, 4, 8], [0, 0, 2, 8]):
        np.testing.assert_array_equal(ex.batch(tok, pos, tab, select=sel), full[sel])
    for bad, err in (([9], BatchIndexError), ([-1], BatchIndexError), ([0] * 5, BatchError), ([], BatchError),
                     ([1.5], BatchError)):
        with pytest.raises(err):
            ex.batch(tok, pos, tab, select=bad)
    with pytest.raises(BatchError, match="last_only or decode"):
        ex.batch(tok, pos, tab, last_only=True, select=[0])


def test_artifact_manifest_and_cache_key(paths):
    m = loaded(paths, "stories")
    plain = compile_native(m, NativeOptions(ctx=CTX)).artifact.manifest
    art = compile_native(m, NativeOptions(ctx=CTX, batch=BATCH, prefill_chunk=16)).artifact.manifest
    other = compile_native(m, NativeOptions(ctx=CTX, batch=dataclasses.replace(BATCH, max_batch=32),
                                            prefill_chunk=16)).artifact.manifest
    assert len({plain["cache_key"], art["cache_key"], other["cache_key"]}) == 3
    assert "batch" not in plain and set(plain["entries"]) == {"decode", "prefill", "prefill_all"}
    assert plain["entries"]["decode"]["inputs"] == {"token": 0}
    # decode rows run through batch (no integer path here), so steps may mix them with prompts
    assert set(art["entries"]) == {"batch", "batch_last", "batch_sel"}
    b = art["batch"]
    assert (b["block_size"], b["n_blocks"], b["max_batch"], b["max_blocks_per_seq"], b["max_rows"]) == \
        (BS, NB, 4, CTX // BS, 16)
    assert other["batch"]["max_rows"] == 32
    io = art["entries"]["batch"]["inputs"]
    assert io == {"tokens": 0, "positions": 64, "block_tables": 128}
    rows_at = 128 + 16 * (CTX // BS) * 4
    assert art["entries"]["batch_sel"]["inputs"] == {**io, "rows": rows_at}     # a row index per sequence
    assert art["entries"]["batch_sel"]["output_shape"] == [4, m.config.vocab_size]
    assert art["io_bytes"] == rows_at + 64          # each input on a cache line
    cfg = m.config
    assert art["state_bytes"] == 2 * cfg.n_layers * NB * BS * cfg.kv_dim * 2    # f16, the default
    assert sum(b["block_bytes"].values()) * NB == art["state_bytes"]


def test_batch_graph_text_and_picture(paths):
    g = build_graphs(loaded(paths, "gemma3"), CompileOptions(ctx=CTX, batch=BATCH, kv_type="q8"))["batch_last"]
    text = print_graph(g)
    assert text.startswith(f"graph gemma3.batch(%tokens: i32[T], %positions: i32[T], %block_tables: i32[T, {CTX // BS}])")
    assert f"state $k_cache.0 : Q8_0:f32[{NB * BS}, 64]" in text
    assert "= kv_write_paged($v_cache.0, %" in text and ", %positions, %block_tables) {block_size=4}" in text
    assert "= rope_kv_write_paged($k_cache.0, %" in text   # the keys' rope and write: passes/fuse_elementwise
    assert "= attention_paged(%" in text and "window=5" in text and "window=0" in text
    assert "= rope(%" in text and "take_last" in text
    dot = to_dot(g, "overview")
    assert "kv_write_paged" in dot and "attention_paged" in dot and "sliding window 5" in dot


def test_load_batch_model(paths):
    """The batch engine's model has its own loader (``runtime.load`` builds
    one stream and takes no batch options): a paged pool, batch steps, and
    none of the single-stream methods."""
    for backend in ("interp", "llvm"):
        m = load_batch_model(DEFAULT_MODEL, DEFAULT_TOKENIZER, backend=backend, ctx=CTX, threads=2,
                             batch=runtime.BatchOptions(block_size=8, max_batch=2))
        assert m.batch == BatchOptions(8, 2 * CTX // 8, 2)
        ex = m.executor
        assert (ex.block_size, ex.n_blocks, ex.max_blocks_per_seq) == (8, 16, 8)
        assert m.kv_bytes == 2 * m.config.n_layers * 16 * 8 * m.config.kv_dim * 2   # f16, the default
        assert ex.batch([1, 1], [0, 0], [[0], [1]]).shape == (2, 512)
        assert not any(hasattr(m, name) for name in ("generate", "logits", "complete", "chat"))
        with pytest.raises(BatchError, match="batched serving"):
            ex.decode(1, 0)
    with pytest.raises(TypeError):
        runtime.load(DEFAULT_MODEL, DEFAULT_TOKENIZER, backend="interp", batch=BatchOptions(block_size=8))
    with pytest.raises(runtime.RunError, match="block_size"):
        load_batch_model(DEFAULT_MODEL, DEFAULT_TOKENIZER, backend="interp", batch=BatchOptions(block_size=0))
