"""How many KV pool blocks a server gets.

Without a budget: enough for ``--parallel`` sequences of the whole context,
so no request ever waits for room once it has a slot (the pool's pages are
only touched as sequences grow). With ``--mem-budget``: what is left of the
budget after the resident weights, the step's arena and scratch, the
runtime and the HTTP stack, so the server's peak memory stays inside it.
"""
from __future__ import annotations


from compiler.driver import BatchOptions, LoadedModel, max_blocks_per_seq
from compiler.host_cores import usable_cores
from passes.memory_budget import runtime_floor

#: the HTTP stack's resident memory beyond lmc's runtime: FastAPI, uvicorn,
#: pydantic, prometheus_client and the event loop, with some margin
SERVER_BASE = 48 << 20


class PoolError(ValueError):
    """The budget cannot hold the model and one request of the context."""


def kv_bytes_per_position(loaded: LoadedModel, kv_type: str) -> float:
    """K and V of every layer for one position."""
    from passes.memory_budget import KV_BYTES

    c = loaded.config
    return 2 * c.n_layers * c.kv_dim * KV_BYTES[kv_type]


def pool_blocks(loaded: LoadedModel, ctx: int, parallel: int, block_size: int, kv_type: str,
                mem_budget: int | None, threads: int) -> int:
    """The pool's blocks. Raises PoolError when a budget cannot hold one
    whole-context sequence next to everything else."""
    per_seq = max_blocks_per_seq(ctx, block_size)
    if mem_budget is None:
        return parallel * per_seq
    from compiler.native import NativeOptions, scratch_floats, plan_native

    plan = plan_native(loaded, NativeOptions(ctx=ctx, kv_type=kv_type, batch=BatchOptions(block_size, 1, parallel)))
    arena = max(p.size for p in plan.plans.values())
    scratch = 4 * scratch_floats(plan.graphs, ctx) * threads
    weights = sum(int(w.ref.nbytes) for w in loaded.weights.values())
    fixed = runtime_floor(loaded.config.vocab_size, 2 << 20) + SERVER_BASE + weights + arena + scratch
    block = kv_bytes_per_position(loaded, kv_type) * block_size
    n = int((mem_budget - fixed) // block)
    if n < per_seq:
        need = fixed + per_seq * block
        raise PoolError(f"--mem-budget {mem_budget / 2**20:.0f} MiB: the model, its working memory and one "
                        f"sequence of {ctx} positions need {need / 2**20:.0f} MiB (lower -c, or use --kv-type "
                        f"f16 or q8)")
    return min(n, parallel * per_seq)


def os_threads(threads: int | None) -> int:
    return threads or usable_cores()
