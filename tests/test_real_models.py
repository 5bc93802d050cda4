"""The real instruct models against llama.cpp under teacher forcing.

SmolLM2-135M-Instruct (llama row, Q4_1) and Qwen2.5-Coder-0.5B-Instruct
(qwen2 row, Q4_K_M: Q5_0/Q8_0/Q4_K/Q6_K) from ../shared's fetch_model.py.
llama.cpp (``xllamacpp``) continues each prompt greedily for 48 tokens and
reports its top-20 log-probabilities; lmc, teacher-forced along the same
tokens, must pick llama.cpp's top-1 at every decisive position (where it
leads by >= 0.5), and most positions must be decisive.
"""
from __future__ import annotations

import numpy as np
import pytest

import runtime
from llamacpp_oracle import compare, have_llamacpp, llamacpp_greedy_many
from shared_data import QWEN, SMOLLM2, instruct_models

PROMPTS = [
    "The three primary colours are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<|im_start|>user\nWhy is the sky blue? Answer in two sentences.<|im_end|>\n<|im_start|>assistant\n",
]
N = 48


@pytest.mark.parametrize("name", [SMOLLM2, QWEN])
def test_real_model_agrees_with_llama_cpp(name):
    have_llamacpp()
    path = instruct_models()[name]
    model = runtime.load(path, threads=2, ctx=256)
    prompts = [model.encode(text, special=True) for text in PROMPTS]
    decisive = equal = positions = 0
    for text, prompt, ref in zip(PROMPTS, prompts, llamacpp_greedy_many(path, prompts, N)):
        logits = model.logits(prompt + ref.generated)
        for k, top in enumerate(ref.top):
            positions += 1
            if top[0][1] - top[1][1] >= 0.5:
                decisive += 1
                equal += int(np.argmax(logits[len(prompt) - 1 + k])) == top[0][0]
        print(compare(lambda seq: logits, prompt, ref).row(f"{name} {text[:24]!r}"))
    print(f"{name}: decisive positions {equal}/{decisive} equal, of {positions}")
    assert decisive >= positions // 2
    assert equal == decisive
