"""Matrix products (``matmul``, ``qmatmul``, ``qmatmul_rows``,
``qmatmul_add``) and embedding lookups: the one dispatch, from a weight's
type through the kernel traits table (``traits``) to its kernels:

* a repacked weight (``TensorType.repack``): ``repacked`` (one arithmetic
  for every row count);
* the integer path (``act``): the type's decode kernel (``int_q8``,
  ``int_qsf``, ``int_kquants``, ``ternary``), driven by ``int_q8.emit_int_matvec``, or for
  a prompt chunk whose rows fill tiles the type's GEMM (``gemm``,
  ``gemm_kquants``);
* else the float path: ``float_tiles`` with the type's decoder
  (``decode_gguf``, ``decode_kquants``, ``decode_qsf``, ``ternary``).

Shared: ``common`` (tiling parameters, output rows), ``..simd`` (vector
helpers and which instructions a target has), ``..act_quant`` (the
activation quantizers, also the KV write's).
"""
from __future__ import annotations

from ir.quant import quant_type

from ..emit import KernelBuilder
from ..kernels import KernelSig, kernel
from . import embedding  # noqa: F401  (registers the embedding kernels)
from . import gemm, gemm_kquants, int_kquants, int_q8, repacked
from .float_tiles import emit_float_matmul
from .traits import make_decoder, traits_of


@kernel("matmul", "qmatmul", "qmatmul_rows", "qmatmul_add")
def emit_matmul(kb: KernelBuilder, sig: KernelSig) -> None:
    wt = sig.in_types[1]
    layout = wt.layout or "F32"
    tr = traits_of(layout)
    if wt.repack:   # weights in VNNI order since load: one kernel for every row count
        if not tr.repacked:
            raise NotImplementedError(f"no repacked kernel for {layout}")
        return repacked.emit_repacked(kb, sig, tr.int_kernel, tr.amx)
    if sig.op == "qmatmul_add":
        raise NotImplementedError("qmatmul_add reads repacked weights")
    if sig.attr.get("act") in ("q8", "q8k"):  # integer path: x quantized per block, int8 dot products
        if tr.int_kernel is None:
            raise NotImplementedError(f"int8 matvec on a {layout} weight")
        kern = tr.int_kernel(kb, sig, quant_type(layout))
        if gemm.use_gemm(sig, kb.vw, kb.target):
            return gemm.emit_int_gemm(kb, sig, kern, tr.gemm, tr.amx)
        return int_q8.emit_int_matvec(kb, sig, kern)
    return emit_float_matmul(kb, sig, make_decoder(kb, wt, kb.in_raw[1]))


def scratch_floats(sig: KernelSig) -> int:
    """Per-thread scratch (float32 elements) a matmul kernel needs: on the
    integer path a slot per row quantized at once, plus 64 bytes slack;
    for a prompt chunk (``gemm``), enough for the GEMM's too; a repacked
    weight's kernel its own. The float path needs none."""
    act = sig.attr.get("act")
    if sig.op not in ("qmatmul", "qmatmul_rows", "qmatmul_add") or act not in ("q8", "q8k"):
        return 0
    if sig.in_types[1].repack:
        return repacked.scratch_bytes(sig) // 4 + 16
    k = int(sig.in_types[1].shape[1])
    if act == "q8k":
        need = int_q8.slot_count(sig) * int_kquants.slot_bytes(k)
    else:
        need = int_q8.slot_count(sig) * int_q8.slot_bytes(k)
    if sig.attr.get("gemm") and len(sig.in_types[0].shape) > 1:   # either kernel may run
        need = max(need, (gemm_kquants if act == "q8k" else gemm).scratch_bytes(sig))
    return need // 4 + 16
