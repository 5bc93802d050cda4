"""llama.cpp's speed on the same file, measured beside ours (``lmc bench
--compare-llamacpp``), through the ``xllamacpp`` package from the package
index (llama.cpp's server as a Python extension; nothing of it is in lmc).

The server runs in a child process (one server per process), is fed random
prompt ids of the same length as our bench, and reports llama.cpp's own
prompt and generation timings; medians over the runs are returned.
"""
from __future__ import annotations

import statistics
from typing import Any

from .peer_child import run_peer

_CHILD = r"""
import json, os, random, sys, urllib.request
import xllamacpp as x
path, threads, n_prompt, n_gen, runs, vocab = sys.argv[1], *map(int, sys.argv[2:7])
p = x.CommonParams()
p.model.path = path
p.n_ctx = max(512, n_prompt + n_gen + 16)
p.port = 0
p.cpuparams.n_threads = threads
p.cpuparams_batch.n_threads = threads
p.warmup = True
s = x.Server(p)
addr = s.listening_address.rstrip("/")
rng = random.Random(0)
out = []
for _ in range(runs):
    body = {"prompt": [rng.randrange(3, vocab) for _ in range(n_prompt)], "n_predict": n_gen,
            "temperature": 0, "top_k": 1, "cache_prompt": False, "ignore_eos": True}
    req = urllib.request.Request(addr + "/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    out.append(json.loads(urllib.request.urlopen(req, timeout=1200).read())["timings"])
sys.stdout.write("\n@@" + json.dumps(out) + "\n")
sys.stdout.flush()
os._exit(0)
"""


def bench_llamacpp(model_path: str, threads: int, prompt_tokens: int, gen_tokens: int, runs: int,
                   vocab: int) -> dict[str, Any]:
    """{"prefill_tok_s", "decode_tok_s", "version"} for llama.cpp, or
    {"error": ...} when it cannot be measured here."""
    t = run_peer(_CHILD, "llama.cpp", ("xllamacpp", "xllamacpp"), model_path, threads, prompt_tokens, gen_tokens, runs, vocab)
    if isinstance(t, dict):   # an error; the child prints a list of runs
        return t
    import xllamacpp as xl

    return {
        "prefill_tok_s": statistics.median(x["prompt_per_second"] for x in t),
        "decode_tok_s": statistics.median(x["predicted_per_second"] for x in t),
        "version": getattr(xl, "__version__", None) or str(getattr(xl, "BUILD_INFO", ""))[:40],
    }
