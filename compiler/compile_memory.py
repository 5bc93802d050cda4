"""How much memory the one-time compile needs, for ``lmc plan``.

Under a memory budget the compile runs in a child process (one kernel
module at a time), so the running process stays within the budget; the
child itself needs LLVM. Measured on x86-64 with llvmlite 0.50, the
child's peak over the resident set of a process that has loaded the model
(``runtime.load``'s, before it compiles): Gemma 3 270M 138 MiB, Qwen2.5
0.5B 154 MiB, SmolLM2 135M 80 MiB, stories260K 62 MiB: LLVM's own code
pages (~74 MB), the child's copy of the model's tables, and LLVM's working
memory for the largest kernel module. ``LLVM_COMPILE_BYTES`` covers the
largest of these with a margin, so the estimate errs high: a budget it
refuses may have fit; on the models measured, one it accepts fits.
"""
from __future__ import annotations

#: what compiling adds to a process that has loaded the model (see above)
LLVM_COMPILE_BYTES = 160 << 20


def resident_bytes() -> int | None:
    """This process's resident set now (Linux), else None."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")


def peak_resident_bytes() -> int | None:
    """This process's peak resident set since it started its program
    (Linux ``VmHWM``: unlike ``getrusage``'s maximum, it does not carry the
    parent's size from before a fork-and-exec), else None."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def compile_peak_estimate(loaded_bytes: int) -> int:
    """The compile child's peak: a process with the model loaded
    (``loaded_bytes``, e.g. this one's resident set) plus LLVM."""
    return loaded_bytes + LLVM_COMPILE_BYTES
