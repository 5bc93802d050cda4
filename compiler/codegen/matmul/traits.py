"""The kernel traits table: for each weight type, the code that reads it.

As ggml's ``type_traits_cpu``, one row per quant type (its facts are its
row in ``ir.quant.table``): the decoder of the float path (stored bytes to
float vectors in registers), the decode kernel of the integer path (its
unsigned quants, scales and dot products), the GEMM of prompt chunks on
the file's layout, and whether it has a repacked kernel (its tiles'
``tile_bytes``). The dispatch (``matmul/__init__``) looks a weight's type
up here and never branches on type names; a new type is a row here and
its kernel module.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import llvmlite.ir as ir

from ir.quant import QUANT_TYPES, quant_type
from ir.types import TensorType

from ..emit import KernelBuilder
from .common import as_int
from .decode_gguf import BF16Decoder, NibbleDecoder, Q8_0Decoder
from .decode_kquants import Q2KDecoder, Q3KDecoder, Q4KDecoder, Q5KDecoder, Q6KDecoder
from .decode_lut import IQ4XSDecoder, LUTDecoder, MXFP4Decoder
from .decode_qsf import QSFQ2Decoder, QSFQ2SDecoder, QSFQ4Decoder, QSFQ8Decoder, QSFTernaryDecoder
from .float_tiles import Decoder, F16Decoder, F32Decoder, planar_decoder
from .gemm import Q8Gemm
from .gemm_kquants import KQGemm
from .int_kquants import Q2KInt, Q3KInt, Q4KInt, Q5KInt, Q6KInt
from .int_lut import IQ4XSIntKernel, LUTIntKernel, MXFP4IntKernel
from .int_q8 import IntKernel, NibbleIntKernel
from .int_qsf import QSFIntKernel
from .ternary import TQ1Decoder, TQ1Int, TQ2Decoder, TQ2Int


@dataclass(frozen=True)
class MatmulTraits:
    """How the matmul kernels read one weight type (None: that path does not)."""

    decoder: type | None = None      # float path: Decoder(kb, raw, n, k, qt)
    int_kernel: type | None = None   # integer path's decode kernel: cls(kb, sig, qt)
    gemm: type | None = None         # integer GEMM of prompt chunks: cls(kb, sig, kern)
    repacked: bool = False           # the repacked kernel reads its tiles (``matmul.repacked``)
    #: several rows at once on AMX tiles where the target has them (``matmul.amx_tiles``):
    #: set where it measured faster than the VNNI code (see the table)
    amx: bool = False


_q8 = dict(gemm=Q8Gemm, repacked=True)
_kq = dict(gemm=KQGemm)
#: ``amx``: AMX against VNNI on one thread, 128 tokens, Emerald Rapids (1536x576
#: weights, 896x4864 for the 256-value blocks; alternated, best of 25): Q4_0 1.16x,
#: Q4_1 1.3-1.4x, Q5_0 1.19x, Q5_1 1.51x, QSF_Q4 1.69x, QSF_Q2 1.20x, TQ1_0 2.07x,
#: TQ2_0 2.10x. Since the symmetric layouts give the tiles their signed quants
#: (``Q8Gemm.amx_signed``: no int32 seed per row in the epilogue; 1536x576, or
#: 1536x1024 for IQ4_XS, medians of 3-5 alternated runs' best): Q4_0x16 1.28x,
#: Q8_0x16 1.19x, IQ4_NL 1.13x, IQ4_XS 1.14x, QSF_Q8 1.11x, MXFP4 1.2x.
#: Not set: within noise of 1 (Q4_K 0.92-1.04x, Q5_K 0.99-1.40x, QSF_TERNARY
#: 1.01x) or slower: the 16-value sub-blocks (Q2_K 0.65x, Q3_K 0.59x,
#: Q6_K 0.64x), whose per-sub-block epilogue outweighs the half-width products.
#: Per 32 values the epilogue (convert, scale, FMA per output) costs what
#: the tile product saves; the ternary types' one scale per 256 values is
#: where the tiles pay.
_amx = dict(amx=True)

TRAITS: dict[str, MatmulTraits] = {
    "F32": MatmulTraits(F32Decoder),
    "F16": MatmulTraits(F16Decoder),
    "BF16": MatmulTraits(BF16Decoder),
    "Q8_0": MatmulTraits(Q8_0Decoder, IntKernel, **_q8, **_amx),
    "Q4_0": MatmulTraits(NibbleDecoder, NibbleIntKernel, **_q8, **_amx),
    "Q4_1": MatmulTraits(NibbleDecoder, NibbleIntKernel, **_q8, **_amx),
    "Q5_0": MatmulTraits(NibbleDecoder, NibbleIntKernel, **_q8, **_amx),
    "Q5_1": MatmulTraits(NibbleDecoder, NibbleIntKernel, **_q8, **_amx),
    "Q2_K": MatmulTraits(Q2KDecoder, Q2KInt, **_kq),
    "Q3_K": MatmulTraits(Q3KDecoder, Q3KInt, **_kq),
    "Q4_K": MatmulTraits(Q4KDecoder, Q4KInt, repacked=True, **_kq),
    "Q5_K": MatmulTraits(Q5KDecoder, Q5KInt, repacked=True, **_kq),
    "Q6_K": MatmulTraits(Q6KDecoder, Q6KInt, repacked=True, **_kq),
    "TQ1_0": MatmulTraits(TQ1Decoder, TQ1Int, **_kq, **_amx),
    "TQ2_0": MatmulTraits(TQ2Decoder, TQ2Int, **_kq, **_amx),
    "IQ4_NL": MatmulTraits(LUTDecoder, LUTIntKernel, Q8Gemm, **_amx),
    "IQ4_XS": MatmulTraits(IQ4XSDecoder, IQ4XSIntKernel, Q8Gemm, **_amx),
    "MXFP4": MatmulTraits(MXFP4Decoder, MXFP4IntKernel, Q8Gemm, **_amx),
    "QSF_Q8": MatmulTraits(QSFQ8Decoder, QSFIntKernel, Q8Gemm, **_amx),
    "QSF_Q4": MatmulTraits(QSFQ4Decoder, QSFIntKernel, Q8Gemm, **_amx),
    "QSF_Q2": MatmulTraits(QSFQ2Decoder, QSFIntKernel, Q8Gemm, **_amx),
    "QSF_Q2S": MatmulTraits(QSFQ2SDecoder, QSFIntKernel, Q8Gemm),
    "QSF_TERNARY": MatmulTraits(QSFTernaryDecoder, QSFIntKernel, Q8Gemm),
}
assert set(TRAITS) == set(QUANT_TYPES), "every quant type has a row here (traits may be all None)"
assert all(TRAITS[n].repacked == (QUANT_TYPES[n].tile_bytes is not None) for n in TRAITS)

_PLANAR_Q8 = re.compile(r"^L2C_Q8G(\d+)$")


def traits_of(layout: str) -> MatmulTraits:
    """The row of a weight type; llama2.c's planar Q8 (any group) has only a decoder."""
    if layout in TRAITS:
        return TRAITS[layout]
    if _PLANAR_Q8.match(layout):
        return MatmulTraits()
    raise NotImplementedError(f"no matmul kernels for weight layout {layout!r}")


def make_decoder(kb: KernelBuilder, wt: TensorType, raw: ir.Value) -> Decoder:
    """The float path's decoder of a weight of type ``wt`` whose bytes are at ``raw``."""
    n, k = as_int(wt.shape[0]), as_int(wt.shape[1])
    name = wt.layout or "F32"
    m = _PLANAR_Q8.match(name)
    if m:
        return planar_decoder(kb, raw, n, k, int(m.group(1)))
    cls = traits_of(name).decoder
    if cls is None:
        raise NotImplementedError(f"no matmul decoder for weight layout {name!r}")
    return cls(kb, raw, n, k, quant_type(name))
