"""Samplers: run.c bit-exactness against a C build of its algorithm, plus the extras."""
from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from runtime.sampling import Sampler, SamplerConfig, XorShiftRng, expf_glibc, softmax_f32

# run.c's sampler (xorshift64*, softmax, sample_mult, sample_topp with qsort),
# re-typed from its algorithm; compiled as run.c is (gcc -O3, no fast-math) so
# it uses the C library's expf and qsort, which is the point of the comparison.
C_SOURCE = r"""
#include <math.h>
#include <stdlib.h>

typedef struct { float prob; int index; } ProbIndex;

unsigned int c_random_u32(unsigned long long *state) {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    return (*state * 0x2545F4914F6CDD1Dull) >> 32;
}

float c_random_f32(unsigned long long *state) {
    return (c_random_u32(state) >> 8) / 16777216.0f;
}

static void softmax(float *x, int n) {
    float mx = x[0];
    for (int i = 1; i < n; i++) if (x[i] > mx) mx = x[i];
    float sum = 0.0f;
    for (int i = 0; i < n; i++) { x[i] = expf(x[i] - mx); sum += x[i]; }
    for (int i = 0; i < n; i++) x[i] /= sum;
}

static int argmax(const float *p, int n) {
    int best = 0; float bp = p[0];
    for (int i = 1; i < n; i++) if (p[i] > bp) { best = i; bp = p[i]; }
    return best;
}

static int mult(const float *p, int n, float coin) {
    float cdf = 0.0f;
    for (int i = 0; i < n; i++) { cdf += p[i]; if (coin < cdf) return i; }
    return n - 1;
}

static int by_prob_desc(const void *a, const void *b) {
    const ProbIndex *x = a, *y = b;
    if (x->prob > y->prob) return -1;
    if (x->prob < y->prob) return 1;
    return 0;
}

static int topp(const float *p, int n, float top_p, ProbIndex *buf, float coin) {
    const float cutoff = (1.0f - top_p) / (n - 1);
    int m = 0;
    for (int i = 0; i < n; i++) if (p[i] >= cutoff) { buf[m].index = i; buf[m].prob = p[i]; m++; }
    qsort(buf, m, sizeof(ProbIndex), by_prob_desc);
    float cum = 0.0f; int last = m - 1;
    for (int i = 0; i < m; i++) { cum += buf[i].prob; if (cum > top_p) { last = i; break; } }
    float r = coin * cum;
    float cdf = 0.0f;
    for (int i = 0; i <= last; i++) { cdf += buf[i].prob; if (r < cdf) return buf[i].index; }
    return buf[last].index;
}

/* run.c's sample(): logits are modified in place, as there. */
int c_sample(float *logits, int n, float temperature, float top_p,
             unsigned long long *state, ProbIndex *buf) {
    if (temperature == 0.0f) return argmax(logits, n);
    for (int i = 0; i < n; i++) logits[i] /= temperature;
    softmax(logits, n);
    float coin = c_random_f32(state);
    if (top_p <= 0 || top_p >= 1) return mult(logits, n, coin);
    return topp(logits, n, top_p, buf, coin);
}

void c_expf(const float *x, float *y, long n) { for (long i = 0; i < n; i++) y[i] = expf(x[i]); }
"""

GLIBC_X86_64 = platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64") \
    and platform.libc_ver()[0] == "glibc"


@pytest.fixture(scope="module")
def clib(tmp_path_factory):
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed: cannot build the C reference sampler")
    d = tmp_path_factory.mktemp("runc_sampler")
    src, lib = d / "sampler.c", d / "libsampler.so"
    src.write_text(C_SOURCE)
    subprocess.run([gcc, "-O3", "-shared", "-fPIC", "-o", str(lib), str(src), "-lm"], check=True)
    so = ctypes.CDLL(str(lib))
    so.c_random_u32.restype = ctypes.c_uint
    so.c_random_u32.argtypes = [ctypes.POINTER(ctypes.c_ulonglong)]
    so.c_random_f32.restype = ctypes.c_float
    so.c_random_f32.argtypes = [ctypes.POINTER(ctypes.c_ulonglong)]
    so.c_sample.restype = ctypes.c_int
    so.c_sample.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_float,
                            ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_void_p]
    so.c_expf.restype = None
    so.c_expf.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    return so


class CSampler:
    """The C reference with its own RNG state, stepping like ours."""

    def __init__(self, so, vocab: int, temperature: float, top_p: float, seed: int) -> None:
        self.so, self.vocab = so, vocab
        self.temperature, self.top_p = temperature, top_p
        self.state = ctypes.c_ulonglong(seed & (2**64 - 1))
        self.buf = np.zeros(2 * vocab, dtype=np.int32)  # ProbIndex[vocab]: 8 bytes each

    def sample(self, logits: np.ndarray) -> int:
        x = np.array(logits, dtype=np.float32)
        return self.so.c_sample(x.ctypes.data, self.vocab, self.temperature, self.top_p,
                                ctypes.byref(self.state), self.buf.ctypes.data)


def make_logits(rng: np.random.Generator, vocab: int, kind: int) -> np.ndarray:
    """Assorted shapes: broad, peaked, tie-heavy (to exercise the sort's tie order), masked."""
    if kind == 0:
        x = rng.normal(0.0, rng.uniform(0.5, 6.0), vocab)
    elif kind == 1:
        x = rng.normal(0.0, 2.0, vocab)
        x[rng.integers(vocab, size=3)] += rng.uniform(5.0, 15.0, 3)
    elif kind == 2:
        x = np.round(rng.normal(0.0, 1.5, vocab) * 2.0) / 2.0  # many exactly equal logits
    else:
        x = rng.normal(0.0, 3.0, vocab)
        masked = rng.random(vocab) < 0.3
        masked[rng.integers(vocab)] = False  # never all -inf
        x[masked] = -np.inf
    return x.astype(np.float32)


def run_both(so, vocab: int, temperature: float, top_p: float, seed: int, steps: int,
             data_seed: int) -> tuple[list[int], list[int]]:
    ours = Sampler(SamplerConfig(temperature=temperature, top_p=top_p, seed=seed), vocab)
    ref = CSampler(so, vocab, temperature, top_p, seed)
    rng = np.random.default_rng(data_seed)
    a, b = [], []
    for step in range(steps):
        logits = make_logits(rng, vocab, step % 4)
        before = logits.copy()
        a.append(ours.sample(logits))
        assert np.array_equal(logits, before, equal_nan=True)  # caller's array untouched
        b.append(ref.sample(logits))
    assert ours.rng.state == ref.state.value  # one coin per step on both sides
    return a, b


# ----------------------------------------------------------------------------
# run.c exactness

needs_glibc = pytest.mark.skipif(not GLIBC_X86_64, reason="expf_glibc reproduces glibc's x86-64 expf; "
                                 "another libm may round a few exp values differently")

SEEDS = [42, 7, 133742, 1234, 1, 2**63 + 5, 2**64 - 1]


def test_xorshift_matches_c(clib):
    for seed in (42, 1, 2**64 - 1, 0xDEADBEEF):
        ours = XorShiftRng(seed)
        st_ = ctypes.c_ulonglong(seed)
        expect = [clib.c_random_u32(ctypes.byref(st_)) for _ in range(1000)]
        assert [ours.random_u32() for _ in range(1000)] == expect
        assert ours.state == st_.value
    ours, st_ = XorShiftRng(42), ctypes.c_ulonglong(42)
    for _ in range(1000):
        f = ours.random_f32()
        assert isinstance(f, np.float32) and 0.0 <= f < 1.0
        assert f == np.float32(clib.c_random_f32(ctypes.byref(st_)))


def test_xorshift_seed_42_first_outputs(clib):
    st_ = ctypes.c_ulonglong(42)
    c_first = [clib.c_random_u32(ctypes.byref(st_)) for _ in range(5)]
    r = XorShiftRng(42)
    assert [r.random_u32() for _ in range(5)] == c_first
    print("seed 42 random_u32:", c_first)


def test_seed_none_and_zero_use_the_clock():
    assert XorShiftRng(None).state != 0
    assert XorShiftRng(0).state != 0  # run.c: -s 0 means "from time(NULL)"
    assert XorShiftRng(-1).state == 2**64 - 1  # C's conversion to unsigned long long


@needs_glibc
def test_expf_glibc_matches_libm(clib):
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.uniform(-110.0, 90.0, 1_000_000), rng.uniform(-25.0, 0.0, 1_000_000),
                        np.float32([0.0, -0.0, -np.inf, np.inf, np.nan, -103.5, -104.0, -103.3,
                                    88.7, 88.8, -87.4, -63.09946060180664])]).astype(np.float32)
    y = np.empty_like(x)
    clib.c_expf(x.ctypes.data, y.ctypes.data, x.size)
    ours = expf_glibc(x)
    same = (ours.view(np.uint32) == y.view(np.uint32)) | (np.isnan(ours) & np.isnan(y))
    assert same.all(), x[~same][:10]
    # np.exp in float32 would not do: it differs in the last bit for many inputs
    assert np.count_nonzero(np.exp(x[:100_000]) != y[:100_000]) > 0


def test_cumsum_is_sequential_float32():
    rng = np.random.default_rng(5)
    a = (rng.random(5000) ** 6).astype(np.float32)
    acc, seq = np.float32(0.0), []
    for v in a:
        acc = np.float32(acc + v)
        seq.append(acc)
    assert np.cumsum(a).dtype == np.float32
    assert np.array_equal(np.cumsum(a), np.array(seq, dtype=np.float32))


def test_softmax_matches_c_sum_order():
    x = np.float32([1.0, 2.0, 3.0, -np.inf])
    p = softmax_f32(x)
    assert p[3] == 0.0 and p.dtype == np.float32
    with pytest.raises(ValueError):
        softmax_f32(np.float32([-np.inf, -np.inf]))


@needs_glibc
@pytest.mark.parametrize("vocab", [512, 32000])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.95, 0.999, 1.0])
def test_matches_runc_sampler(clib, vocab, top_p):
    temps = [0.1, 0.5, 0.8, 1.0, 1.3, 2.0]
    steps = 40 if vocab == 512 else 12
    for i, temperature in enumerate(temps):
        seed = SEEDS[(i + int(top_p * 1000)) % len(SEEDS)]
        a, b = run_both(clib, vocab, temperature, top_p, seed, steps, data_seed=1000 * i + vocab)
        assert a == b, (temperature, top_p, seed)


@needs_glibc
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(1, 2**64 - 1),
       temperature=st.floats(0.05, 3.0),
       top_p=st.one_of(st.floats(0.01, 1.0), st.just(1.0), st.just(0.9)),
       vocab=st.sampled_from([2, 3, 17, 512, 32000]),
       data_seed=st.integers(0, 2**32 - 1))
def test_matches_runc_sampler_hypothesis(clib, seed, temperature, top_p, vocab, data_seed):
    # Below 1/vocab, a flat distribution can leave no token above run.c's
    # cutoff (1 - topp) / (n - 1); run.c then reads probindex[-1] (undefined).
    assume(top_p >= 1.0 / vocab + 1e-3)
    steps = 30 if vocab <= 512 else 6
    a, b = run_both(clib, vocab, temperature, top_p, seed, steps, data_seed)
    assert a == b


@needs_glibc
def test_ties_follow_stable_order(clib):
    # Equal probabilities everywhere: which id a coin lands on depends only on
    # the order the sort leaves ties in (glibc's qsort is a stable merge sort).
    vocab = 4096
    logits = np.zeros(vocab, dtype=np.float32)
    logits[::7] = 1.0
    ours = Sampler(SamplerConfig(temperature=1.0, top_p=0.6, seed=99), vocab)
    ref = CSampler(clib, vocab, 1.0, 0.6, 99)
    got = [ours.sample(logits) for _ in range(300)]
    assert got == [ref.sample(logits) for _ in range(300)]
    assert len(set(got)) > 50


def test_top_p_below_the_cutoff_keeps_every_token():
    # run.c's undefined case (no candidate reaches the cutoff): we keep all
    # tokens, so the most probable one (lowest id on ties) fills the nucleus.
    s = Sampler(SamplerConfig(temperature=1.0, top_p=0.25, seed=1), 2)
    assert [s.sample(np.float32([0.5, 0.5])) for _ in range(20)] == [0] * 20
    one = Sampler(SamplerConfig(temperature=1.0, top_p=0.5, seed=1), 1)  # n - 1 == 0
    assert one.sample(np.float32([3.0])) == 0


def test_greedy_reference_is_argmax_and_draws_no_coin():
    rng = np.random.default_rng(11)
    s = Sampler(SamplerConfig(temperature=0.0, seed=5), 1000)
    state = s.rng.state
    for _ in range(50):
        x = rng.normal(size=1000).astype(np.float32)
        assert s.sample(x) == int(np.argmax(x))
    assert s.rng.state == state
    x = np.float32([0.0, 3.0, 1.0, 3.0])
    assert Sampler(SamplerConfig(), 4).sample(x) == 1  # first index on ties


# ----------------------------------------------------------------------------
# the extra samplers


def test_top_k_1_is_argmax():
    rng = np.random.default_rng(12)
    s = Sampler(SamplerConfig(temperature=1.5, top_k=1, seed=3), 2000)
    for _ in range(50):
        x = rng.normal(size=2000).astype(np.float32)
        assert s.sample(x) == int(np.argmax(x))
    ties = np.float32([1.0, 5.0, 5.0, 0.0])
    assert {Sampler(SamplerConfig(temperature=1.0, top_k=1, seed=sd), 4).sample(ties)
            for sd in range(1, 40)} == {1}


def test_top_k_keeps_the_k_largest_lower_ids_on_ties():
    x = np.float32([3.0, 1.0, 3.0, 3.0, 2.0])
    seen = {Sampler(SamplerConfig(temperature=1.0, top_k=2, seed=sd), 5).sample(x) for sd in range(1, 200)}
    assert seen == {0, 2}
    # k >= vocab is no filter at all: identical to the run.c path, step for step
    rng = np.random.default_rng(13)
    a = Sampler(SamplerConfig(temperature=0.9, top_p=0.9, top_k=512, seed=8), 512)
    b = Sampler(SamplerConfig(temperature=0.9, top_p=0.9, seed=8), 512)
    for _ in range(50):
        v = rng.normal(0, 3, 512).astype(np.float32)
        assert a.sample(v) == b.sample(v)


def test_top_k_draws_one_coin_per_step():
    s = Sampler(SamplerConfig(temperature=1.0, top_k=1, seed=77), 10)
    r = XorShiftRng(77)
    for _ in range(5):
        s.sample(np.arange(10, dtype=np.float32))
        r.random_u32()
    assert s.rng.state == r.state


def test_min_p_drops_unlikely_tokens():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    x = np.log(probs).astype(np.float32)

    def counts(min_p: float, n: int = 4000) -> np.ndarray:
        s = Sampler(SamplerConfig(temperature=1.0, min_p=min_p, seed=2024), 4)
        return np.bincount([s.sample(x) for _ in range(n)], minlength=4)

    c = counts(0.2)  # threshold 0.1: token 3 goes
    assert c[3] == 0 and (c[:3] > 0).all()
    c = counts(0.5)  # threshold 0.25: tokens 0 and 1 remain, renormalised to 5/8 and 3/8
    assert c[2] == c[3] == 0
    assert abs(c[0] / c.sum() - 0.625) < 0.03
    assert (counts(0.99, 200) == [200, 0, 0, 0]).all()
    base = counts(0.0)  # off: all four appear
    assert (base > 0).all()


def test_min_p_with_top_p():
    x = np.log(np.array([0.4, 0.3, 0.2, 0.1])).astype(np.float32)
    seen = set()
    for sd in range(1, 400):
        s = Sampler(SamplerConfig(temperature=1.0, top_p=0.8, min_p=0.6, seed=sd), 4)
        seen.add(s.sample(x))
    assert seen == {0, 1}  # top-p keeps 0, 1, 2; min-p (0.24) then drops 2


def test_presence_and_frequency_penalties_as_openai_defines_them():
    """logit - count * frequency_penalty - (count > 0) * presence_penalty over
    the window, after the repetition penalty (llama.cpp's order)."""
    x = np.array([3.0, 2.5, 2.0, -1.0], np.float32)
    hist = [0, 0, 0, 1]          # id 0 three times, id 1 once
    # frequency 0.2: id 0 at 3 - 3*0.2 = 2.4 beats id 1 at 2.5 - 0.2 = 2.3; at 0.3 it is 2.1 against 2.2
    assert Sampler(SamplerConfig(frequency_penalty=0.2), 4).sample(x, hist) == 0
    assert Sampler(SamplerConfig(frequency_penalty=0.3), 4).sample(x, hist) == 1
    # presence: once per seen id; 0.6 leaves id 0 on top (2.4), 1.1 puts the unseen id 2 (2.0) above 1.9
    assert Sampler(SamplerConfig(presence_penalty=0.6), 4).sample(x, hist) == 0
    assert Sampler(SamplerConfig(presence_penalty=1.1), 4).sample(x, hist) == 2
    # negative values encourage repeats
    assert Sampler(SamplerConfig(presence_penalty=-2.0), 4).sample(np.array([0.0, 1.0, 0.0, 0.0], np.float32),
                                                                    [0]) == 0
    # both with the repetition penalty: (3 / 1.5) - 3*0.1 - 0.1 = 1.6 < 2.0 (unseen id 2)
    assert Sampler(SamplerConfig(repeat_penalty=1.5, frequency_penalty=0.1, presence_penalty=0.1), 4).sample(
        x, hist) == 2
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3.0}, {"presence_penalty": float("nan")}):
        with pytest.raises(ValueError):
            SamplerConfig(**bad).validate()


def test_repeat_penalty_changes_greedy_choice():
    x = np.float32([2.0, 1.9, -1.0, 0.5])
    assert Sampler(SamplerConfig(), 4).sample(x, [0]) == 0
    s = Sampler(SamplerConfig(repeat_penalty=1.1), 4)
    assert s.sample(x, [0]) == 1  # 2.0 / 1.1 < 1.9
    assert s.sample(x, [0, 0, 0]) == 1  # a repeated id is penalised once
    # negative logits are multiplied: -1.0 * 1.1 < -1.05
    y = np.float32([-1.0, -1.05, -3.0])
    assert Sampler(SamplerConfig(repeat_penalty=1.1), 3).sample(y, [0]) == 1
    # outside the window: no penalty
    w = Sampler(SamplerConfig(repeat_penalty=1.1, repeat_last_n=2), 4)
    assert w.sample(x, [0, 3, 3]) == 0
    assert Sampler(SamplerConfig(repeat_penalty=1.1, repeat_last_n=0), 4).sample(x, [0]) == 0
    assert Sampler(SamplerConfig(repeat_penalty=1.1, repeat_last_n=-1), 4).sample(x, [0] + [3] * 500) == 1
    with pytest.raises(ValueError):
        s.sample(x, [7])


def test_logits_are_not_mutated_on_any_path():
    rng = np.random.default_rng(21)
    x = rng.normal(size=300).astype(np.float32)
    before = x.copy()
    for cfg in (SamplerConfig(), SamplerConfig(temperature=0.7, top_p=0.9, seed=1),
                SamplerConfig(temperature=0.7, top_k=20, min_p=0.1, repeat_penalty=1.3, seed=1)):
        Sampler(cfg, 300).sample(x, [1, 2, 3])
        assert np.array_equal(x, before)


def test_bad_logits_are_rejected():
    s = Sampler(SamplerConfig(temperature=1.0, seed=1), 3)
    with pytest.raises(ValueError):
        s.sample(np.float32([0.0, np.nan, 1.0]))
    with pytest.raises(ValueError):
        s.sample(np.zeros(4, dtype=np.float32))


@pytest.mark.parametrize("kwargs, flag", [
    ({"temperature": -0.1}, "--temp"),
    ({"temperature": float("nan")}, "--temp"),
    ({"top_p": 0.0}, "--top-p"),
    ({"top_p": 1.5}, "--top-p"),
    ({"top_k": -1}, "--top-k"),
    ({"min_p": 1.0}, "--min-p"),
    ({"min_p": -0.1}, "--min-p"),
    ({"repeat_penalty": 0.0}, "--repeat-penalty"),
    ({"repeat_last_n": -2}, "--repeat-last-n"),
])
def test_validation_names_the_flag(kwargs, flag):
    cfg = SamplerConfig(**kwargs)
    with pytest.raises(ValueError, match="^" + flag + " ") as e:
        cfg.validate()
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=flag):
        Sampler(cfg, 10)


def test_native_softmax_is_bit_identical_to_the_emulation():
    """The compiled softmax calls the C library's expf; on glibc x86-64 it
    must equal the numpy emulation bit for bit (including -inf entries)."""
    from compiler.codegen.k_sampler import native_softmax
    from runtime.sampling import expf_glibc

    rng = np.random.default_rng(5)
    for n in (7, 4096, 32000):
        x = (rng.standard_normal(n) * 8).astype(np.float32)
        x[rng.integers(0, n, n // 10)] = -np.inf
        got = native_softmax(x)
        assert got is not None
        m = x.max()
        e = expf_glibc(x - m)
        want = e / np.cumsum(e)[-1]
        if GLIBC_X86_64:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-6)


def test_native_draw_is_runc_sample_mult_over_the_native_softmax():
    """The fused softmax-and-draw lands where run.c's sample_mult lands on
    the native softmax's probabilities: the first running float32 sum above
    the coin, else the last token (coins at the very top of the sum)."""
    from compiler.codegen.k_sampler import native_sample_mult, native_softmax

    rng = np.random.default_rng(6)
    for n in (4096, 151936):
        x = (rng.standard_normal(n) * 4).astype(np.float32)
        x[rng.integers(0, n, n // 10)] = -np.inf
        cdf = np.cumsum(native_softmax(x))     # float32, sequential, as run.c's cdf
        coins = np.concatenate([rng.random(300), [0.0, cdf[-1], np.nextafter(cdf[-1], 0), 0.999999]])
        for c in coins.astype(np.float32):
            want = min(int(np.searchsorted(cdf, c, side="right")), n - 1)
            assert native_sample_mult(x, c) == want


def _top_k_reference(x: np.ndarray, k: int) -> np.ndarray:
    n = x.shape[0]
    thr = np.partition(x, n - k)[n - k]
    above = np.flatnonzero(x > thr)
    ties = np.flatnonzero(x == thr)[: k - above.size]
    return np.sort(np.concatenate([above, ties]))


@pytest.mark.parametrize("k", [1, 2, 40, 100])
def test_top_k_narrowed_by_chunk_maxima_keeps_the_same_ids(k):
    """Large vocabularies first keep the logits >= the k-th largest chunk
    maximum: the ids are those of one partition over all, ties included
    (few distinct values), -inf included."""
    from runtime.sampling import top_k_ids

    rng = np.random.default_rng(k)
    for n in (151936, 32000, 50000):
        for x in ((rng.standard_normal(n) * 3).astype(np.float32),
                  rng.integers(0, 6, n).astype(np.float32),            # ties across the boundary
                  np.where(rng.random(n) < 0.999, -np.inf, 1.0).astype(np.float32)):
            np.testing.assert_array_equal(top_k_ids(x, k), _top_k_reference(x, k))


def test_large_vocabulary_paths_do_not_mutate_and_validate():
    rng = np.random.default_rng(22)
    x = rng.normal(size=151936).astype(np.float32)
    before = x.copy()
    for cfg in (SamplerConfig(), SamplerConfig(temperature=1.0, seed=1),
                SamplerConfig(temperature=0.7, top_k=40, seed=1),
                SamplerConfig(temperature=0.7, top_k=20, presence_penalty=0.5, repeat_penalty=1.3, seed=1)):
        Sampler(cfg, x.size).sample(x, [1, 2, 3])
        assert np.array_equal(x, before)
    for bad in (np.nan, np.inf):
        y = x.copy()
        y[12345] = bad
        for cfg in (SamplerConfig(), SamplerConfig(temperature=1.0, seed=1)):
            with pytest.raises(ValueError, match="NaN or \\+inf"):
                Sampler(cfg, y.size).sample(y)
    with pytest.raises(ValueError, match="every logit is -inf"):
        Sampler(SamplerConfig(temperature=1.0, seed=1), 8192).sample(np.full(8192, -np.inf, np.float32))


def test_vector_expf_is_glibc_expf_over_a_sweep_of_floats():
    """Where glibc runs its FMA build the compiled softmax computes expf 8
    lanes at a time (``compiler.codegen.k_sampler.vector_expf``): over every 97th float32
    from -110 to 90 (the subnormal, underflow and overflow ranges), the
    thresholds and the infinities, it equals the emulation of the library's
    expf, and so the library's (``test_expf_glibc_matches_libm``)."""
    from compiler.codegen.k_sampler import (EXPF_MAY_UNDERFLOW, EXPF_OVERFLOW, EXPF_UNDERFLOW, native_exps,
                                            vector_exp_here)
    from runtime.sampling import expf_glibc

    if not GLIBC_X86_64:
        pytest.skip("the vector expf reproduces glibc's x86-64 FMA build only")
    from compiler.codegen.target import host_target
    assert vector_exp_here() == host_target().has("fma")
    neg = np.arange(0x80000000, 0xC2DC0000, 97, dtype=np.uint64)
    pos = np.arange(0, 0x42B40000, 97, dtype=np.uint64)
    x = np.concatenate([neg, pos]).astype(np.uint32).view(np.float32)
    edges = [t + d for t in (EXPF_UNDERFLOW, EXPF_MAY_UNDERFLOW, EXPF_OVERFLOW) for d in (np.float32(0), np.float32(1e-5), np.float32(-1e-5))]
    x = np.concatenate([x, edges, [-np.inf, np.inf, np.uint32(0xC27C65D9).view(np.float32)]]).astype(np.float32)
    got = native_exps(x)
    np.testing.assert_array_equal(got.view(np.uint32), expf_glibc(x).view(np.uint32))


def _nucleus_reference(probs: np.ndarray, top_p: np.float32) -> np.ndarray:
    n = probs.shape[0]
    cand = np.flatnonzero(probs >= (np.float32(1.0) - top_p) / np.float32(n - 1))
    if cand.size == 0:
        cand = np.arange(n)
    order = cand[np.argsort(-probs[cand], kind="stable")]
    cum = np.cumsum(probs[order])
    return order[: min(int(np.searchsorted(cum, top_p, side="right")), cum.shape[0] - 1) + 1]


def test_top_p_from_the_most_probable_first_keeps_the_same_nucleus():
    """The nucleus is first sought among the most probable candidates (with
    every tie of the last): the same ids in the same order as one stable
    sort of all candidates, peaked or flat, with ties, small or large."""
    from runtime.sampling import top_p_nucleus

    rng = np.random.default_rng(30)
    for it in range(200):
        n = int(rng.choice([40, 300, 5000, 151936]))
        x = (rng.standard_normal(n) * rng.choice([0.5, 3, 8])).astype(np.float32)
        if it % 3 == 0:
            x = np.round(x)                      # many ties
        p = softmax_f32(x / np.float32(rng.choice([0.3, 1.0, 3.0])))
        top_p = np.float32(rng.choice([0.05, 0.5, 0.9, 0.95, 0.999]))
        np.testing.assert_array_equal(top_p_nucleus(p, top_p), _nucleus_reference(p, top_p))


def test_the_written_out_exp2_table_is_the_computed_one():
    """k_sampler's table of 2^(i/32) (glibc's ``__exp2f_data.tab``) is written
    out for a fast start; it must be what the 60-digit computation gives."""
    from compiler.codegen.k_sampler import EXP2F_TABLE, _exp2_table

    assert EXP2F_TABLE.dtype == np.uint64 and EXP2F_TABLE.shape == (32,)
    np.testing.assert_array_equal(EXP2F_TABLE, _exp2_table())


def test_logit_bias():
    """OpenAI's logit_bias: added to the tokens' logits first, greedy included; a token id
    outside the vocabulary or a bias outside [-100, 100] is refused."""
    logits = np.array([1.0, 3.0, 2.0, 0.5], np.float32)
    assert Sampler(SamplerConfig(), 4).sample(logits) == 1
    assert Sampler(SamplerConfig(logit_bias={1: -100.0}), 4).sample(logits) == 2
    assert Sampler(SamplerConfig(logit_bias={3: 2.6}), 4).sample(logits) == 3
    # the caller's logits are not modified
    assert logits.tolist() == [1.0, 3.0, 2.0, 0.5]
    # probabilities see the bias too (what speculative acceptance and logprobs read)
    p = Sampler(SamplerConfig(temperature=1.0, logit_bias={0: 100.0}), 4).probs(logits)
    assert p[0] > 0.999
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Sampler(SamplerConfig(logit_bias={4: 1.0}), 4)
    with pytest.raises(ValueError, match=r"not in \[-100, 100\]"):
        Sampler(SamplerConfig(logit_bias={0: 101.0}), 4)
    with pytest.raises(ValueError, match=r"not in \[-100, 100\]"):
        Sampler(SamplerConfig(logit_bias={0: float("nan")}), 4)
