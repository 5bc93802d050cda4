"""Code generation with llvmlite: target, kernels, lowering, JIT."""
