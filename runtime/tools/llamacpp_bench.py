"""llama.cpp's speed on the same file, measured beside ours (``lmc bench
--compare-llamacpp``), through the ``xllamacpp`` package from the package
index (llama.cpp's server as a Python extension; nothing of it is in lmc).

The server runs in a child process (one server per process), is fed random
prompt ids of the same length as our bench (or the bench's own prompt
text), and reports llama.cpp's own prompt and generation timings; medians
over the runs are returned. With a JSON schema each run also generates
under it (llama.cpp's ``json_schema`` request field, its grammar sampler),
right after the plain generation or right before it, in turns as ours.
"""
from __future__ import annotations

import json
import statistics
from typing import Any

from .peer_child import run_peer

_CHILD = r"""
import json, os, random, sys, urllib.request
import xllamacpp as x
path, threads, n_prompt, n_gen, runs, vocab = sys.argv[1], *map(int, sys.argv[2:7])
extra = json.loads(sys.argv[7])   # {"prompt": text or None, "schema": a JSON schema or None}
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

def complete(body):
    req = urllib.request.Request(addr + "/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=1200).read())["timings"]

out, constrained = [], []
for i in range(runs):
    prompt = extra["prompt"] if extra["prompt"] is not None else [rng.randrange(3, vocab) for _ in range(n_prompt)]
    base = {"prompt": prompt, "n_predict": n_gen, "temperature": 0, "top_k": 1, "cache_prompt": False}
    schema_run = lambda: constrained.append(complete({**base, "json_schema": extra["schema"]}))
    if extra["schema"] is not None and i % 2:
        schema_run()
    out.append(complete({**base, "ignore_eos": True}))
    if extra["schema"] is not None and not i % 2:
        schema_run()
sys.stdout.write("\n@@" + json.dumps([out, constrained]) + "\n")
sys.stdout.flush()
os._exit(0)
"""


def bench_llamacpp(model_path: str, threads: int, prompt_tokens: int, gen_tokens: int, runs: int,
                   vocab: int, prompt_text: str | None = None,
                   json_schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """{"prefill_tok_s", "decode_tok_s", "version"} for llama.cpp (and
    "constrained_decode_tok_s", "constrained_vs_plain" under ``json_schema``),
    or {"error": ...} when it cannot be measured here."""
    extra = json.dumps({"prompt": prompt_text, "schema": json_schema})
    t = run_peer(_CHILD, "llama.cpp", ("xllamacpp", "xllamacpp"), model_path, threads, prompt_tokens, gen_tokens,
                 runs, vocab, extra)
    if isinstance(t, dict):   # an error; the child prints its runs
        return t
    import xllamacpp as xl

    plain, constrained = t
    out = {
        "prefill_tok_s": statistics.median(x["prompt_per_second"] for x in plain),
        "decode_tok_s": statistics.median(x["predicted_per_second"] for x in plain),
        "version": getattr(xl, "__version__", None) or str(getattr(xl, "BUILD_INFO", ""))[:40],
    }
    if constrained:   # llama.cpp's generation timings include its sampling, as our loop figures do
        out["constrained_decode_tok_s"] = statistics.median(x["predicted_per_second"] for x in constrained)
        out["constrained_vs_plain"] = statistics.median(
            c["predicted_per_second"] / p["predicted_per_second"] for c, p in zip(constrained, plain))
        out["constrained_tokens"] = statistics.median(x["predicted_n"] for x in constrained)
    return out
