"""OpenVINO GenAI's speed on the same GGUF file, measured beside ours (``lmc
bench --compare-openvino``), through the ``openvino-genai`` package from the
package index (its ``LLMPipeline`` reads GGUF directly; nothing of it is in
lmc, and lmc does not depend on it).

It runs in a child process (its threads must not share ours), on random
prompt ids of our bench's length, greedy, with its own timings: prefill
from the time to the first token, decode from the time per output token;
medians over the runs. Its GGUF reader takes the llama, qwen2 and qwen3
families with Q4_0, Q4_1, Q4_K, Q6_K, Q8_0 and F16 tensors; any other file
gives {"error": <its message>}, which the bench prints as one line.
"""
from __future__ import annotations

import statistics
from typing import Any

from .peer_child import run_peer

_CHILD = r"""
import json, os, random, sys
import numpy as np
import openvino as ov
import openvino_genai as og
path, threads, n_prompt, n_gen, runs, vocab = sys.argv[1], *map(int, sys.argv[2:7])
pipe = og.LLMPipeline(path, "CPU", INFERENCE_NUM_THREADS=threads)
cfg = og.GenerationConfig(max_new_tokens=n_gen, min_new_tokens=n_gen, do_sample=False)
rng = random.Random(0)
out = []
for r in range(runs + 1):   # the first run warms up (compilation of its kernels) and is not counted
    ids = np.array([[rng.randrange(3, vocab) for _ in range(n_prompt)]], dtype=np.int64)
    inputs = og.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
    res = pipe.generate(inputs, cfg)
    pm = res.perf_metrics
    if r:
        out.append({"ttft_ms": pm.get_ttft().mean, "tpot_ms": pm.get_tpot().mean,
                    "new_tokens": int(pm.get_num_generated_tokens())})
sys.stdout.write("\n@@" + json.dumps({"runs": out, "version": og.__version__}) + "\n")
sys.stdout.flush()
os._exit(0)
"""


def bench_openvino(model_path: str, threads: int, prompt_tokens: int, gen_tokens: int, runs: int,
                   vocab: int) -> dict[str, Any]:
    """{"prefill_tok_s", "decode_tok_s", "version"} for OpenVINO GenAI, or
    {"error": ...} when it cannot be measured here (not installed, or its
    reader refuses the file)."""
    t = run_peer(_CHILD, "OpenVINO GenAI", ("openvino_genai", "openvino-genai"), model_path, threads, prompt_tokens, gen_tokens, runs, vocab)
    if "error" in t:
        return t
    return {
        # the time to the first token is the prefill and the first token's sampling
        "prefill_tok_s": prompt_tokens / (statistics.median(x["ttft_ms"] for x in t["runs"]) / 1000),
        "decode_tok_s": 1000 / statistics.median(x["tpot_ms"] for x in t["runs"]),
        "version": t["version"],
    }
