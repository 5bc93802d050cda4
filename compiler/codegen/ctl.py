"""The control block's layout: what the compiled steps and the runtime
that drives them agree on (slot numbers, profile regions, stream error
codes). A module of its own, so the runtime reads it without importing
the code generator (and llvmlite's IR builder) on a warm start."""
from __future__ import annotations


class Ctl:
    """Slot numbers in the control block (i64 each)."""

    GENERATION = 0
    QUIT = 1
    ENTRY = 2
    POS = 3
    T = 4
    NTHREADS = 5
    WEIGHTS = 6
    ARENA = 7
    STATE = 8
    IO = 9
    SCRATCH = 10
    SCRATCH_STRIDE = 11
    SLEEPERS = 12        # workers blocked in futex_wait on GENERATION's low 32 bits
    BARRIER_COUNT = 16
    BARRIER_GEN = 24
    PROFILE = 28         # profiling builds: address of the i64 time accumulators (ns)
    PROFILE_T0 = 29      # profiling builds: when lmc_run began (ns)
    SLOTS = 64          # 32.. : streaming (see lower_stream.StreamSlots)


PROFILE_HEADER = 4   # a step's profile region: last mark, steps, dispatch, exit, then the nodes


class StreamSlots:
    """Control-block slots of the streaming machinery (i64 each)."""

    IO_DONE = 32
    BUF0 = 33
    BUF1 = 34
    FD = 35
    FD_REPACKED = 36     # the repacked weights' file (ranges FROM_REPACKED), -1 without
    COMP_DONE = 40
    BASE = 41
    WAIT_NS = 42
    READ_NS = 48
    READ_BYTES = 49
    IO_ERROR = 50
    IO_IDLE_NS = 51
    TOUCH_SINK = 52
    STAGE = 53           # buffer for a compressed layer's stored bytes
    LZ4_FN = 54          # int LZ4_decompress_safe(src, dst, srcSize, dstCapacity)
    ZSTD_FN = 55         # size_t ZSTD_decompress(dst, dstCapacity, src, srcSize)


#: IO_ERROR values: a failed or short read, a layer that did not decompress
IO_ERR_READ = 1
IO_ERR_DECOMPRESS = 2
