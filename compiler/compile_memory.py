"""How much memory the one-time compile needs, for ``lmc plan``.

Under a memory budget the compile runs in a child process (one kernel
module at a time), so the running process stays within the budget; the
child itself needs LLVM. Measured on x86-64 with llvmlite 0.50 (Gemma 3
270M, Qwen2.5 0.5B, SmolLM2 135M): compiling adds 119-121 MB to the
resident set of a process that has loaded the model, ~74 MB of it LLVM's
own code pages and ~46 MB its working memory, whatever the model (the
largest kernel module, not the model, sets the working memory).
"""
from __future__ import annotations

#: what compiling adds to a process that has loaded the model (see above)
LLVM_COMPILE_BYTES = 120 << 20


def resident_bytes() -> int | None:
    """This process's resident set now (Linux), else None."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")


def compile_peak_estimate(loaded_bytes: int) -> int:
    """The compile child's peak: a process with the model loaded
    (``loaded_bytes``, e.g. this one's resident set) plus LLVM."""
    return loaded_bytes + LLVM_COMPILE_BYTES
