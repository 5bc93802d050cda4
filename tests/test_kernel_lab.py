"""``lmc kernel``: one kernel compiled on its own, checked against its op's
reference, timed on N threads, its code generator parameters as options.

Timing never decides a test here: only the correctness verdicts, the
reported parameters, the generated code and the error handling do. The
softmax op (added for the lab) is also checked directly against its
reference, as the other kernels are in tests/test_kernels_*.py."""
from __future__ import annotations

import json
import re

import llvmlite.ir as llir
import numpy as np
import pytest

from compiler.codegen.harness import CompiledKernel, run_kernel_like_reference, sig_for
from compiler.codegen.kernels import emit_kernel
from compiler.codegen.target import host_target
from ir.ops import softmax_ref
from ir.types import TensorType, f32
from runtime.tools import kernel_lab
from runtime.cli import main

HOST_VW = host_target().vector_width
#: cheap runs: one thread, one timed batch
QUICK = ["-t", "1", "--repeats", "1"]


def lab_json(capsys, *argv: str) -> dict:
    rc = main(["kernel", *argv, "--json"])
    out = capsys.readouterr().out
    r = json.loads(out)
    assert rc == (0 if r.get("correct", r.get("all_correct")) else 1)
    return r


def show_ir(capsys, *argv: str) -> str:
    assert main(["kernel", *argv, "--show", "ir"]) == 0
    text = capsys.readouterr().out
    # the kernel's name hashes its signature (attributes included): compare bodies
    return re.sub(r"k_\w+?_[0-9a-f]{10}", "KERNEL", text)


# --- every layout, checked ---------------------------------------------------------------------
@pytest.mark.parametrize("qtype", kernel_lab.supported_layouts())
def test_qmatvec_every_layout(capsys, qtype):
    r = lab_json(capsys, "qmatvec", "--qtype", qtype, "--rows", "64", "--cols", "256", "--repeats", "1")
    assert r["correct"] is True, r
    assert r["kind"] == "qmatvec" and r["qtype"] == qtype and r["op"] == "qmatmul"
    # float32 rounding of 256-term dot products of values ~0.05 x ~1
    assert 0.0 <= r["max_abs_error"] < 1e-4 and r["rel_error"] < 1e-5, r
    assert r["params"]["vector_width"] == HOST_VW
    assert r["params"]["dot"] == ("int" if kernel_lab.default_int_dot(
        kernel_lab.Problem("qmatvec", 64, 256, qtype=qtype)) else "float")
    assert r["bytes_read"] > 64 * 256 // 4 and r["flops"] == 2 * 64 * 256  # >= 2 bits a weight (QSF_Q2)
    for key in ("median_us", "gb_s", "gflop_s"):  # figures present; their size is never tested
        assert isinstance(r[key], (int, float)) and r[key] >= 0
    m = r["machine"]
    assert m["read_gb_s"] > 0 and m["peak_gflop_s"] > 0 and m["threads"] == r["threads"]


def test_supported_layouts():
    names = kernel_lab.supported_layouts()
    for t in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
              "L2C_Q8G64"):
        assert t in names


@pytest.mark.parametrize("argv", [
    ["matvec", "--rows", "100", "--cols", "300"],
    ["matmul", "--rows", "64", "--cols", "96", "--batch", "5"],
    ["qmatmul", "--qtype", "Q4_K", "--rows", "40", "--cols", "512", "--batch", "7"],
    ["qmatmul", "--qtype", "Q8_0", "--rows", "40", "--cols", "64", "--batch", "3", "--int-dot"],
    ["rmsnorm", "--rows", "3", "--cols", "768"],
    ["rope", "--rows", "3", "--cols", "256", "--style", "neox"],
    ["attention", "--rows", "37", "--cols", "256", "--kv-heads", "2", "--batch", "3"],
    ["softmax", "--rows", "5", "--cols", "1000"],
])
def test_other_kinds(capsys, argv):
    r = lab_json(capsys, *argv, *QUICK)
    assert r["correct"] is True, r
    assert r["max_abs_error"] < 1e-3


def test_threads_share_the_work(capsys):
    """More threads than rows of some shares, and than cores: still every
    output written once (the output starts as NaN)."""
    for t in ("2", "3"):
        r = lab_json(capsys, "qmatvec", "--qtype", "Q5_K", "--rows", "7", "--cols", "512", "-t", t, "--repeats", "1")
        assert r["correct"] is True and r["threads"] == int(t)
    r = lab_json(capsys, "attention", "--rows", "20", "--cols", "128", "-t", "3", "--repeats", "1")
    assert r["correct"] is True


# --- parameters reach the emitters ---------------------------------------------------------------
@pytest.mark.parametrize("argv,want", [
    (["qmatvec", "--qtype", "Q4_K", "--unroll", "2", "--tile", "3", "--vector-width", "8", "--float-dot"],
     {"vector_width": 8, "rows": 3, "unroll": 2, "dot": "float"}),
    (["qmatvec", "--qtype", "Q5_K", "--unroll", "2", "--tile", "3", "--vector-width", "8", "--int-dot"],
     {"vector_width": 8, "rows": 3, "unroll": 2, "dot": "int"}),
    (["qmatvec", "--qtype", "Q4_0", "--unroll", "1", "--tile", "2", "--float-dot"],
     {"vector_width": HOST_VW, "rows": 2, "unroll": 1, "dot": "float"}),
    (["qmatvec", "--qtype", "Q8_0", "--unroll", "3", "--tile", "4", "--int-dot", "--vector-width", "8"],
     {"vector_width": 8, "rows": 4, "unroll": 3, "dot": "int"}),
    (["qmatmul", "--qtype", "Q6_K", "--batch", "5", "--tile", "2x3", "--unroll", "2", "--vector-width", "4",
      "--float-dot"],
     {"vector_width": 4, "rows": 2, "tile_tokens": 3, "unroll": 2, "dot": "float"}),
    (["matvec", "--unroll", "5", "--tile", "4"], {"vector_width": HOST_VW, "rows": 4, "unroll": 5}),
])
def test_variants_are_correct(capsys, argv, want):
    r = lab_json(capsys, *argv, "--rows", "64", "--cols", "512", *QUICK)
    assert r["correct"] is True, r
    assert r["params"] == want


def test_other_kinds_take_their_parameters(capsys):
    r = lab_json(capsys, "rmsnorm", "--rows", "2", "--cols", "512", "--unroll", "2", "--vector-width", "8", *QUICK)
    assert r["correct"] and r["params"] == {"vector_width": 8, "unroll": 2}
    r = lab_json(capsys, "attention", "--rows", "50", "--cols", "128", "--unroll", "16", *QUICK)
    assert r["correct"] and r["params"]["unroll"] == 16
    r = lab_json(capsys, "softmax", "--rows", "3", "--cols", "999", "--unroll", "3", "--vector-width", "4", *QUICK)
    assert r["correct"] and r["params"] == {"vector_width": 4, "unroll": 3}


def test_options_change_the_generated_code(capsys):
    base = ["qmatvec", "--qtype", "Q4_K", "--rows", "64", "--cols", "512", "--float-dot"]
    default = show_ir(capsys, *base)
    assert "define" in default
    assert show_ir(capsys, *base, "--unroll", "2", "--tile", "4") != default
    assert show_ir(capsys, *base, "--vector-width", "8") != default
    # the defaults made explicit are the same code: no attribute = today's constants
    assert show_ir(capsys, *base, "--unroll", "8", "--tile", "1", "--vector-width", str(HOST_VW)) == default
    q8 = ["qmatvec", "--qtype", "Q8_0", "--rows", "64", "--cols", "512"]
    assert show_ir(capsys, *q8, "--int-dot") != show_ir(capsys, *q8, "--float-dot")
    assert show_ir(capsys, *base[:-1], "--int-dot") != default
    # decode matvecs on quantized weights prefetch ahead of their rows; --prefetch 0 turns it off
    for q in (base, [*base[:-1], "--int-dot"], [*q8, "--int-dot"]):
        on = show_ir(capsys, *q)
        assert "llvm.prefetch" in on and "llvm.prefetch" not in show_ir(capsys, *q, "--prefetch", "0")
        assert show_ir(capsys, *q, "--prefetch", "2048") == on
    assert "llvm.prefetch" not in show_ir(capsys, "matvec", "--rows", "64", "--cols", "512")


def test_show_asm(capsys):
    assert main(["kernel", "rmsnorm", "--rows", "2", "--cols", "256", "--show", "asm"]) == 0
    out = capsys.readouterr().out
    assert "lmc_kernel:" in out and "ret" in out


def _tuning(sig, vw=HOST_VW) -> dict:
    rec: dict = {}
    emit_kernel(llir.Module(), sig, vw, rec)
    return rec


def test_default_tuning_is_the_emitters_constants():
    """What the emitters choose without attributes (the compiler's code)."""
    def qmv(layout, k, **attrs):
        return sig_for("qmatmul", [TensorType((k,)), TensorType((8, k), "f32", layout)], layout=layout, **attrs)

    assert _tuning(qmv("Q4_K", 2048)) == {"rows": 1, "unroll": 8}      # short rows: one at a time, 2 x unroll
    assert _tuning(qmv("Q4_K", 8192)) == {"rows": 4, "unroll": 4}      # long rows: 4 rows share x
    assert _tuning(qmv("Q8_0", 2048, act="q8")) == {"rows": 1, "unroll": 2}
    pre = sig_for("qmatmul", [TensorType(("T", 512)), TensorType((8, 512), "f32", "Q4_0")], layout="Q4_0")
    assert _tuning(pre, 16) == {"rows": 4, "tile_tokens": 4, "unroll": 1}
    assert _tuning(pre, 8) == {"rows": 3, "tile_tokens": 3, "unroll": 1}
    assert _tuning(qmv("Q4_K", 2048, rows=2, unroll=3)) == {"rows": 2, "unroll": 3}
    # a batch of decode rows: decode's tiles, several tokens (float) or quantized rows (int) per tile
    rows = sig_for("qmatmul", [TensorType(("T", 2048)), TensorType((8, 2048), "f32", "Q4_K")], layout="Q4_K",
                   decode_rows=8)
    assert _tuning(rows) == {"rows": 1, "unroll": 8, "tile_tokens": 4}
    rows = sig_for("qmatmul", [TensorType(("T", 2048)), TensorType((8, 2048), "f32", "Q8_0")], layout="Q8_0",
                   act="q8", decode_rows=8)
    assert _tuning(rows) == {"rows": 1, "unroll": 2, "slots": 8}


# --- sweep ------------------------------------------------------------------------------------------
def test_sweep_text(capsys):
    rc = main(["kernel", "qmatvec", "--qtype", "Q8_0", "--rows", "32", "--cols", "256", "--sweep",
               "--vector-width", str(HOST_VW), "--unroll", "2", *QUICK])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    head = next(i for i, l in enumerate(lines) if "median us" in l)
    table = [l for l in lines[head + 1:] if l.strip() and not l.startswith("best:")]
    # rows per tile 1, 2, 4 on the float and the integer path (one of them the default)
    assert len(table) >= 6, out
    assert all(l.rstrip().split()[-1] in ("yes", "default") for l in table), out
    assert sum("<- default" in l for l in table) == 1
    best = [l for l in lines if l.startswith("best: ")]
    assert len(best) == 1 and "--vector-width" in best[0] and " us " in best[0], out


def test_sweep_json(capsys):
    r = lab_json(capsys, "softmax", "--rows", "2", "--cols", "300", "--sweep", *QUICK)
    assert r["all_correct"] is True
    params = [v["params"] for v in r["sweep"]]
    assert len(params) == len({json.dumps(p, sort_keys=True) for p in params})  # no duplicates
    assert {p["unroll"] for p in params} >= {1, 2, 4, 8}
    assert sum(v["default"] for v in r["sweep"]) == 1
    assert r["best"] in r["sweep"] and r["best"]["correct"]


# --- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["qmatvec", "--qtype", "Q9_9", "--rows", "64", "--cols", "256"],        # unknown qtype
    ["qmatvec", "--rows", "64", "--cols", "256"],                           # q-kind without a qtype
    ["matvec", "--qtype", "Q4_0", "--rows", "64", "--cols", "256"],         # qtype on a float kind
    ["qmatvec", "--qtype", "Q4_K", "--rows", "64", "--cols", "300"],        # not whole super-blocks
    ["qmatvec", "--qtype", "Q8_0", "--rows", "64", "--cols", "100"],        # not whole blocks
    ["qmatvec", "--qtype", "Q8_0", "--rows", "0", "--cols", "256"],         # rows <= 0
    ["matvec", "--rows", "-3", "--cols", "256"],
    ["matvec", "--rows", "x", "--cols", "256"],
    ["matvec", "--rows", "8", "--cols", "256", "--tile", "abc"],            # --tile does not parse
    ["matvec", "--rows", "8", "--cols", "256", "--tile", "4x"],
    ["matvec", "--rows", "8", "--cols", "256", "--tile", "0"],
    ["matvec", "--rows", "8", "--cols", "256", "--tile", "4x4"],            # tokens per tile, one token
    ["softmax", "--rows", "8", "--cols", "256", "--tile", "4"],             # tiles are for matrices
    ["rope", "--rows", "8", "--cols", "256", "--unroll", "2"],              # rope has no unroll
    ["matvec", "--rows", "8", "--cols", "256", "--int-dot"],
    ["qmatvec", "--qtype", "F16", "--rows", "8", "--cols", "256", "--int-dot"],
    ["qmatvec", "--qtype", "L2C_Q8G64", "--rows", "8", "--cols", "96", "--unroll", "2"],  # row-wise path
    ["qmatvec", "--qtype", "Q8_0", "--rows", "8", "--cols", "256", "--vector-width", "12"],
    ["matvec", "--rows", "8", "--cols", "256", "--batch", "4"],
    ["rmsnorm", "--rows", "8", "--cols", "256", "--unroll", "3"],           # does not divide the row
    ["attention", "--rows", "8", "--cols", "100"],                          # no head_dim fits
    ["attention", "--rows", "8", "--cols", "256", "--kv-heads", "3"],
    ["attention", "--rows", "2", "--cols", "256", "--batch", "3"],
    ["rope", "--rows", "2", "--cols", "256", "--head-dim", "7"],
    ["unknownkind", "--rows", "2", "--cols", "256"],
    ["matvec", "--rows", "2", "--cols", "256", "--show", "ir", "--sweep"],
    ["matvec", "--rows", "200000", "--cols", "200000"],                     # too large to allocate
    ["qmatvec", "--qtype", "Q8_0", "--rows", "8", "--cols", "256", "--prefetch", "-64"],
])
def test_bad_input_is_one_line(capsys, argv):
    assert main(["kernel", *argv]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    lines = cap.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmc: error: "), cap.err
    assert "Traceback" not in cap.err


def test_a_layout_without_a_native_kernel_is_refused(capsys, monkeypatch):
    """Every stored layout has a native matmul today; were one without, the
    lab would say so in one line, naming the ones it has."""
    monkeypatch.setattr(kernel_lab, "supported_layouts", lambda: ("F32", "F16", "Q8_0"))
    assert main(["kernel", "qmatvec", "--qtype", "Q2_K", "--rows", "64", "--cols", "256"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Q2_K has no native matmul kernel (supported: F32, F16, Q8_0)" in err, err


def test_parse_tile():
    assert kernel_lab.parse_tile("4") == (4, None)
    assert kernel_lab.parse_tile("3x2") == (3, 2)
    assert kernel_lab.parse_tile("3X2") == (3, 2)
    for bad in ("", "x", "1x2x3", "-1", "2.5", "65"):
        with pytest.raises(kernel_lab.KernelLabError):
            kernel_lab.parse_tile(bad)


# --- the softmax op's kernel against its reference ------------------------------------------------
_SOFTMAX: dict = {}


@pytest.mark.parametrize("vw", sorted({4, 8, HOST_VW}))
@pytest.mark.parametrize("shape,T", [((1,), None), ((37,), None), ((5, 100), None), (("T", 1000), 3),
                                     ((3, 7), None), ((2, 64), None), (("T", 129), 6)])
@pytest.mark.parametrize("unroll", [None, 1, 3])
def test_softmax_kernel(shape, T, vw, unroll):
    attrs = {} if unroll is None else {"unroll": unroll}
    sig = sig_for("softmax", [f32(*shape)], **attrs)
    if (sig, vw) not in _SOFTMAX:
        _SOFTMAX[(sig, vw)] = CompiledKernel(sig, vector_width=vw)
    k = _SOFTMAX[(sig, vw)]
    rng = np.random.default_rng(len(shape) * 1000 + shape[-1])
    rows = T or (shape[0] if len(shape) > 1 else 1)
    x = (rng.standard_normal((rows, shape[-1])) * 8).astype(np.float32)
    x[0, 0] = -np.inf                     # a masked position
    x[-1, -1] = 80.0                      # large: exp(x - max) must not overflow
    if len(shape) == 1:
        x = x[0]
    want = softmax_ref(x)
    for nt in (1, 2, 3):
        got = run_kernel_like_reference(sig, [x], nthreads=nt, symbols={"T": T} if T else None, kernel=k)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-9)
        np.testing.assert_allclose(got.sum(axis=-1), 1.0, rtol=1e-5)


def test_softmax_shape_rule():
    from ir.ops import ShapeError, get_op

    assert get_op("softmax").infer([f32("T", 10)], {}) == f32("T", 10)
    with pytest.raises(ShapeError):
        get_op("softmax").infer([f32(3, "T")], {})
