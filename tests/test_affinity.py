"""The routing policy of ``lmc serve --replicas`` (``runtime.cluster.affinity``),
without Ray: the replica holding the longest run of a prompt's blocks wins,
unless loads are uneven; a prompt just routed counts as held at once; an
old guess and a forgotten replica count for nothing."""
from __future__ import annotations

from runtime.cluster.affinity import PENDING_S, AffinityIndex
from runtime.engine.block_manager import prefix_hashes


def test_affinity_prefers_the_longest_cached_run_unless_loads_are_uneven():
    a, b = prefix_hashes(list(range(64)), 16), prefix_hashes([7] * 64, 16)
    idx = AffinityIndex(balance_abs=2, balance_rel=1.5)
    idx.publish("r1", a[:3])
    idx.publish("r2", b)
    d = idx.choose(["r1", "r2"], {"r1": 1, "r2": 0}, a)
    assert d.order == ["r1", "r2"] and d.reason == "cache" and d.matched_blocks == 3
    assert idx.choose(["r1", "r2"], {}, b).order[0] == "r2"
    d = idx.choose(["r1", "r2"], {"r1": 4, "r2": 1}, a)          # 3 more and over 1.5x: the idle one
    assert d.order[0] == "r2" and d.reason == "balance"
    d = idx.choose(["r1", "r2"], {}, prefix_hashes([9] * 64, 16))  # nobody holds it: least loaded, fewest blocks
    assert d.reason == "load" and d.order[0] == "r1"
    # a prompt just routed counts as held at once, until the replica's own account replaces it
    c = prefix_hashes([5] * 48, 16)
    idx.routed("r2", c)
    assert idx.choose(["r1", "r2"], {}, c).order[0] == "r2"
    idx.publish("r2", b + c)
    assert idx.views["r2"].pending == {} and idx.matched("r2", c) == 3
    idx.routed("r1", c)
    idx.views["r1"].pending = {h: t - PENDING_S - 1 for h, t in idx.views["r1"].pending.items()}
    assert idx.matched("r1", c) == 0                                # an old guess no longer counts
    idx.forget("r2")
    assert idx.matched("r2", c) == 0
