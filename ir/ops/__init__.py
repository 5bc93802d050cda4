"""The op registry and the ops, one module per family; the names others
use are here. Importing the package registers every op."""
from ..weight_data import WeightData, unrepacked
from .registry import OPS, OpDef, ShapeError, f32_of, get_op, register
from .elementwise import (GLU_ACTS, add_ref, bias_add_ref, gelu_tanh_ref, glu_ref, mul_ref, scale_ref, silu_ref,
                          softcap_ref, softmax_ref)
from .norm import layernorm_ref, rmsnorm_ref
from .select import embedding_ref, pos_embedding_ref, take_last_ref, take_rows_ref
from .matmul import dequant_ref, matmul_ref, qmatmul_add_ref, qmatmul_ref, qmatmul_rows_ref
from .rope import rope_ref
from .attention import (attention_paged_ref, attention_ref, kv_write_paged_ref, kv_write_ref, paged_rows,
                        rope_kv_write_paged_ref, rope_kv_write_ref)

__all__ = ["GLU_ACTS", "OPS", "OpDef", "ShapeError", "WeightData", "add_ref", "attention_paged_ref", "attention_ref",
           "bias_add_ref", "dequant_ref", "embedding_ref", "f32_of", "gelu_tanh_ref", "get_op", "glu_ref",
           "kv_write_paged_ref", "kv_write_ref", "layernorm_ref", "matmul_ref", "mul_ref", "paged_rows",
           "pos_embedding_ref", "qmatmul_add_ref", "qmatmul_ref", "qmatmul_rows_ref", "register", "rmsnorm_ref",
           "rope_kv_write_paged_ref", "rope_kv_write_ref", "rope_ref", "scale_ref", "silu_ref", "softcap_ref",
           "softmax_ref", "take_last_ref", "take_rows_ref", "unrepacked"]
