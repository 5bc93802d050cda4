"""Shared assertion for compiled matmul kernels against their references."""
from __future__ import annotations

import numpy as np

from compiler.codegen.target import Target, host_target
from ir.ops import WeightData


def portable_target(vw: int | None = None) -> Target:
    """The host without the x86 instructions the integer kernels name
    (``vpdpbusd``, ``pmaddubsw``, ``vpsadbw`` ...), so they emit their
    portable forms. At width 16 it keeps AVX-512F (16 lanes) and drops BW
    and VNNI; below 16 it drops AVX2 and AVX-512 as well."""
    host = host_target()
    if (vw or host.vector_width) >= 16:
        return host.variant(host.cpu, ("avx512bw", "avx512vnni", "avxvnni", "avx512vbmi", "avx512bitalg",
                                       "avx512fp16", "avx512bf16", "amx"))
    return host.variant(host.cpu, ("avx2", "avx512", "amx", "avxvnni"))


def check_dot(got: np.ndarray, want: np.ndarray, x: np.ndarray, w: WeightData, floor: float = 1e-37) -> None:
    """Equal up to float32 rounding of a dot product: error relative to
    sum |x||w| (the scale of the terms, which cancellation does not shrink)."""
    wf = w.to_f32().astype(np.float64)
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(wf).T
    assert got.shape == want.shape
    assert np.all(np.isfinite(got)), got
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    bad = err > 1e-5 * scale + floor
    assert not bad.any(), (np.argwhere(bad)[:5], got[bad][:5], want[bad][:5], scale[bad][:5])


def check_within(got: np.ndarray, want: np.ndarray, scale: np.ndarray, rel: float = 1e-5) -> None:
    """Equal up to ``rel`` of each element's term scale (an integer-path
    kernel's products are exact, only the float epilogue rounds)."""
    assert got.shape == want.shape and np.all(np.isfinite(got))
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    bad = err > rel * scale + 1e-30
    assert not bad.any(), (np.argwhere(bad)[:5], got[bad][:5], want[bad][:5])


def call_with_guard(k, x: np.ndarray, w: WeightData, T: int, nt: int) -> np.ndarray:
    """Run an integer matmul kernel ``k`` on every thread id with a scratch of
    exactly the size its rule asks for, followed by a guard zone that must
    stay untouched."""
    from compiler.codegen import matmul

    need = matmul.scratch_floats(k.sig)
    out = np.zeros((T, int(w.type.shape[0])) if x.ndim == 2 else int(w.type.shape[0]), np.float32)
    for tid in range(nt):
        scratch = np.full(need + 256, 12345.0, np.float32)
        k(out, [x, w], T=T, tid=tid, nthreads=nt, scratch=scratch)
        assert np.all(scratch[need:] == 12345.0), "the kernel wrote past its scratch"
    return out


#: greedy tokens of the interpreter and native code may part only where the interpreter's top two
#: logits are this close (relative to the top one, at least 1): there float rounding (an activation's
#: int8 step on the other side of .5) may pick either
TIE = 1e-3


def same_tokens_interp_and_native(path, passes: tuple[str, ...]) -> None:
    """A model's greedy tokens through the interpreter (the numpy references)
    and through native code under the same passes, the prompt prefilled:
    the same, or parting at a tie (``TIE``) of the interpreter's logits
    (an exact comparison passed or failed by the luck of the tokens)."""
    import runtime

    ref = runtime.load(path, backend="interp", passes=passes)
    nat = runtime.load(path, backend="llvm", threads=2, use_cache=False, passes=passes)
    ids = [1, 5, 77, 260, 9, 42]
    want = list(ref.generate(ids, 8, temperature=0.0))
    got = list(nat.generate(ids, 8, temperature=0.0))
    if got == want:
        return
    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    row = np.asarray(ref.logits(ids + want[:i])[-1], np.float64)
    top2 = np.sort(row)[-2:]
    assert top2[1] - top2[0] <= TIE * max(1.0, abs(top2[1])), \
        f"greedy tokens part at step {i} ({got[i]} native, {want[i]} interpreter) with top two logits {top2}"


# --- compiled kernels shared by the layout test files ------------------------------------------
_KERNELS: dict = {}


def compiled(sig, vector_width=None):
    """One CompiledKernel per signature, width and prefill K chunk (a test may patch the chunk)."""
    from compiler.codegen.matmul import float_tiles
    from compiler.codegen.harness import CompiledKernel

    key = (sig, vector_width, float_tiles.K_CHUNK)
    if key not in _KERNELS:
        _KERNELS[key] = CompiledKernel(sig, vector_width=vector_width)
    return _KERNELS[key]


def activations(rng: np.random.Generator, t: int | None, k: int) -> np.ndarray:
    return rng.standard_normal((k,) if t is None else (t, k)).astype(np.float32)


def run_qmatmul(x: np.ndarray, w: WeightData, nthreads: int, vector_width=None) -> tuple[np.ndarray, np.ndarray]:
    """The native qmatmul on ``x`` (one row, or T rows) and the numpy reference's answer."""
    from compiler.codegen.harness import run_kernel_like_reference, sig_for
    from ir.ops import qmatmul_ref
    from ir.types import TensorType

    k, lay = int(w.type.shape[1]), w.type.layout
    sig = sig_for("qmatmul", [TensorType((k,) if x.ndim == 1 else ("T", k)), w.type], layout=lay)
    sym = {"T": x.shape[0]} if x.ndim == 2 else None
    got = run_kernel_like_reference(sig, [x, w], nthreads=nthreads, symbols=sym, kernel=compiled(sig, vector_width))
    return got, qmatmul_ref(x, w, layout=lay)


def run_embedding(w: WeightData, ids: np.ndarray, nt: int, vector_width=None) -> np.ndarray:
    from compiler.codegen.harness import run_kernel_like_reference, sig_for
    from ir.types import TensorType

    ids = np.asarray(ids, np.int32)
    sig = sig_for("embedding", [w.type, TensorType(() if ids.ndim == 0 else ("T",), "i32")])
    sym = {"T": ids.shape[0]} if ids.ndim else None
    return run_kernel_like_reference(sig, [w, ids], nthreads=nt, symbols=sym, kernel=compiled(sig, vector_width))


def check_long_rows_and_k_chunks(make_weight) -> None:
    """Decode with K >= 8192 (4 rows share each x load) and prefill with
    K >= 2048 (K cut into chunks, partial sums added in out), on weights
    from ``make_weight(rng, n, k)``."""
    rng = np.random.default_rng(9)
    for n, k, t in ((5, 8192, None), (3, 2112, 6)):
        w = make_weight(rng, n, k)
        x = activations(rng, t, k)
        got, want = run_qmatmul(x, w, 2)
        check_dot(got, want, x, w)
