"""Graph -> graph rewrites and analyses. Each pass is registered by name."""
from .registry import PASSES, Pass, register_pass  # noqa: F401
from . import fuse_dequant, fuse_elementwise, fuse_norm, fuse_residual, dce, int_dot, repack, schedule, split_rows  # noqa: F401  (register the passes)
