"""What a model's compiled code computes and is, as hashes: run before and
after a change that must not alter either (a refactoring), then compare.

    python scripts/same_numbers.py MODEL [MODEL ...] -o before.json
    ... change the code ...
    python scripts/same_numbers.py MODEL [MODEL ...] -o after.json --against before.json

For each model it records, with two threads:
* logits: sha256 of the float32 bits of every prompt row (one prefill), of
  decode steps over the same ids, and of the rows of a served batch (the
  paged batch entry), on a fixed prompt;
* kernels: for every node of every compiled entry (decode, prefill,
  prefill_all, verify; batch, batch_last, batch_decode), sha256 of its
  kernel's assembly with the kernel's own symbol renamed (a kernel's name
  hashes its signature, which a refactoring may spell differently).
With ``--kernels`` it records instead the assembly of matmul and embedding
kernels for every weight type, row count, kernel choice and vector width
(8 and 16), models or not. With ``--against`` it prints what differs and
exits 1 if anything does.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if "LMC_CACHE_DIR" not in os.environ:   # a private cache, removed at exit
    import atexit
    import shutil

    os.environ["LMC_CACHE_DIR"] = tempfile.mkdtemp(prefix="lmc-same-numbers-")
    atexit.register(shutil.rmtree, os.environ["LMC_CACHE_DIR"], ignore_errors=True)

from compiler.codegen.jit import emit_assembly  # noqa: E402
from compiler.codegen.kernels import KernelSig, emit_kernel  # noqa: E402
from compiler.codegen.target import host_target  # noqa: E402
from compiler.driver import BatchOptions, load_model  # noqa: E402
from compiler.native import NativeOptions, compile_native  # noqa: E402
from runtime.native import NativeExecutor  # noqa: E402

CTX = 256
IDS_LEN = 24


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, np.float32).tobytes()).hexdigest()[:16]


def kernel_asm_hash(sig: KernelSig, vw: int) -> str:
    import llvmlite.ir as ir

    m = ir.Module(name="k")
    fn = emit_kernel(m, sig, vw)
    fn.linkage = "external"
    text = str(m).replace(sig.name, "lmc_kernel")
    import llvmlite.binding as llvm

    from compiler.codegen.jit import optimize

    t = host_target()
    mod = llvm.parse_assembly(text)
    mod.triple = t.triple
    optimize(mod, t, 3)
    return hashlib.sha256(t.machine(3).emit_assembly(mod).encode()).hexdigest()[:16]


def kernel_catalogue() -> dict[str, str]:
    """Assembly hashes of the matmul family's kernels, by a readable key."""
    from compiler.codegen.harness import sig_for
    from ir.quant import QUANT_TYPES, repackable
    from ir.types import TensorType

    out = {}
    layouts = [*QUANT_TYPES, "L2C_Q8G32", "L2C_Q8G64"]
    for vw in (8, 16):
        for lay in layouts:
            qt = QUANT_TYPES.get(lay)
            k = 1024 if qt is not None and qt.block == 256 else 512
            wt = TensorType((64, k), "f32", lay)
            op, attrs = ("matmul", {}) if lay == "F32" else ("qmatmul", {"layout": lay})
            cases = {"decode": ((k,), {}), "prefill": (("T", k), {}), "rows": (("T", k), {"decode_rows": 4})}
            if qt is not None and qt.act:
                a = {"act": qt.act}
                cases.update({"int decode": ((k,), a), "int rows": (("T", k), {**a, "decode_rows": 4}),
                              "int gemm": (("T", k), {**a, "gemm": 64})})
            for name, (xs, extra) in cases.items():
                sig = sig_for(op, [TensorType(xs), wt], **attrs, **extra)
                out[f"{lay} {name} vw{vw}"] = kernel_asm_hash(sig, vw)
            out[f"{lay} embedding vw{vw}"] = kernel_asm_hash(
                sig_for("embedding", [TensorType((64, k), "f32", lay), TensorType(("T",), "i32")]), vw)
            if lay in repackable():
                rt = repacked_type(lay, k, vw)
                if rt is None:
                    continue
                a = {"layout": lay, "act": qt.act}
                for name, xs in (("decode", (k,)), ("prefill", ("T", k))):
                    out[f"{lay} repacked {name} vw{vw}"] = kernel_asm_hash(sig_for("qmatmul", [TensorType(xs), rt], **a), vw)
                    nt = TensorType((k,))
                    out[f"{lay} repacked norm {name} vw{vw}"] = kernel_asm_hash(
                        sig_for("qmatmul", [TensorType(xs), rt, nt], **a, norm_eps=1e-6), vw)
                    rs = TensorType((64,) if len(xs) == 1 else ("T", 64))
                    out[f"{lay} repacked add {name} vw{vw}"] = kernel_asm_hash(
                        sig_for("qmatmul_add", [TensorType(xs), rt, rs], **a), vw)
    return out


def repacked_type(layout: str, k: int, vw: int):
    """The repacked weight type at the GEMM's width for ``vw``, or None."""
    from compiler.codegen.target import host_target
    from ir.types import TensorType

    t = host_target()
    if not (t.has("avx512vnni") or t.has("avxvnni")):
        return None
    return TensorType((64, k), "f32", layout, 16 if vw == 16 else 8)


def model_record(path: str, tokenizer: str | None) -> dict:
    m = load_model(path, tokenizer)
    vocab = m.config.vocab_size
    rng = np.random.default_rng(5)
    ids = [1] + [int(t) for t in rng.integers(3, min(vocab, 5000), IDS_LEN - 1)]
    single = compile_native(m, NativeOptions(ctx=CTX, prefill_chunk=8, verify=True, use_cache=False))
    ex = NativeExecutor(single.artifact, m.path, threads=2)
    rows = np.array(ex.prefill(ids, 0, all_logits=True))
    ex.reset()
    steps = np.stack([np.array(ex.decode(t, p)) for p, t in enumerate(ids)])
    bo = BatchOptions(block_size=4, n_blocks=4 * (CTX // 4), max_batch=4)
    batched = compile_native(m, NativeOptions(ctx=CTX, prefill_chunk=8, batch=bo, use_cache=False))
    bex = NativeExecutor(batched.artifact, m.path, threads=2)
    table = list(range(CTX // 4))
    batch = np.array(bex.batch(ids[:8], list(range(8)), [table] * 8))
    vw = host_target().vector_width
    kernels: dict[str, list] = {}
    memo: dict[KernelSig, str] = {}
    for res in (single, batched):
        for gname, g in (res.graphs or {}).items():
            row = []
            for n in g.nodes:
                if n.op in ("const",):
                    continue
                sig = KernelSig.of(n)
                if sig not in memo:
                    try:
                        memo[sig] = kernel_asm_hash(sig, vw)
                    except NotImplementedError:
                        memo[sig] = "-"
                row.append([n.op, memo[sig]])
            kernels[gname] = row
    return {"logits": {"prefill_rows": _sha(rows), "decode_steps": _sha(steps), "batch_rows": _sha(batch)},
            "kernels": kernels, "unique_kernels": sorted(set(memo.values()))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help="model files; MODEL:TOKENIZER for llama2.c checkpoints")
    ap.add_argument("--kernels", action="store_true", help="the matmul kernels of every type instead")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--against", help="a JSON written before: report differences")
    a = ap.parse_args()
    rec = {"cpu": host_target().cpu, "models": {}}
    if a.kernels:
        rec["kernels"] = kernel_catalogue()
        print(f"{len(rec['kernels'])} kernels", file=sys.stderr)
    for spec in a.models:
        path, _, tok = spec.partition(":")
        rec["models"][os.path.basename(path)] = model_record(path, tok or None)
        print(f"{os.path.basename(path)}: done", file=sys.stderr)
    with open(a.out, "w") as f:
        json.dump(rec, f, indent=1)
    if not a.against:
        return 0
    with open(a.against) as f:
        old = json.load(f)
    bad = 0
    if a.kernels:
        old_k = old.get("kernels", {})
        diff = sorted(k for k, v in rec["kernels"].items() if old_k.get(k) != v)
        bad += len(diff)
        print(f"kernels: {len(rec['kernels']) - len(diff)} of {len(rec['kernels'])} identical"
              + (f"; different: {', '.join(diff[:20])}" if diff else ""))
    for name, r in rec["models"].items():
        o = old["models"].get(name)
        if o is None:
            print(f"{name}: not in {a.against}")
            bad += 1
            continue
        for k, v in r["logits"].items():
            same = v == o["logits"][k]
            bad += not same
            print(f"{name} {k}: {'same bits' if same else 'DIFFERENT'} ({v})")
        for gname, row in r["kernels"].items():
            orow = o["kernels"].get(gname)
            diff = [i for i, (x, y) in enumerate(zip(row, orow or [])) if x[1] != y[1]]
            if orow is None or len(orow) != len(row) or diff:
                bad += 1
                print(f"{name} {gname}: kernels differ at nodes {diff[:10]} (of {len(row)} vs {len(orow or [])})")
        print(f"{name}: {len(r['unique_kernels'])} kernels, {len(set(r['unique_kernels']) & set(o['unique_kernels']))} "
              f"identical to before")
    print("everything identical" if not bad else f"{bad} differences")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
