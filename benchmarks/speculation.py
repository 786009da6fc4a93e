"""n-gram speculation (prompt lookup) against plain decoding, through llmd's API.

(a) an input-grounded task (repeat a ~150-token function) and (b) free chat, each with
speculation off and ngram: decode tokens/s, the ratio to off, and the acceptance rate. Also the
ceiling on this machine, (k+1) x t(0) / t(k) for the best k (verifying k drafts is not free on a
CPU), and llama-cpp-python's LlamaPromptLookupDecoding on (a) as the anchor.

    python benchmarks/speculation.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import med, start_llmd, stop, stream_openai_chat, wait_idle  # noqa: E402

from llmd.models.catalog import find_packaged  # noqa: E402

FUNCTION = '''def parse_config(path):
    """Read a key = value file, skipping comments and blank lines."""
    config = {}
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                raise ValueError(f"line {number}: expected key = value, got {line!r}")
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config
'''
TASKS = {"(a) repeat a function": "Repeat this function exactly, with no comment:\n\n" + FUNCTION,
         "(b) free chat": "Tell me a story about a fox and a crow."}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    proc, url, _ = start_llmd({"LLMD_SLOTS": "1", "LLMD_RESPONSE_CACHE": "0"})
    rows = []
    try:
        stream_openai_chat(url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                 "speculation": "ngram"})
        wait_idle(url)  # the engine measures t(k) once it is idle after its first speculating request
        for task, prompt in TASKS.items():
            for mode in ("off", "ngram"):
                tps, acc = [], []
                for _ in range(args.runs):
                    wait_idle(url)
                    s = stream_openai_chat(url, {"messages": [{"role": "user", "content": prompt}], "max_tokens": 200,
                                                 "temperature": 0, "speculation": mode, "cache_prompt": False})
                    tps.append(s.decode_tps)
                r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
                    "messages": [{"role": "user", "content": prompt}], "max_tokens": 200, "temperature": 0,
                    "speculation": mode, "cache_prompt": False}).json()["usage"]["completion_tokens_details"]
                drafted = r["accepted_prediction_tokens"] + r["rejected_prediction_tokens"]
                acc.append(r["accepted_prediction_tokens"] / drafted if drafted else float("nan"))
                rows.append((task, mode, med(tps), acc[0], drafted))
        cost = httpx.get(url + "/llmd/status").json()["loaded"][0]["stats"]["verify_cost_ms"]
    finally:
        stop(proc)
    cost = {int(k): v for k, v in cost.items()}
    ceiling_k = max(cost, key=lambda k: (k + 1) * cost[0] / cost[k])
    ceiling = (ceiling_k + 1) * cost[0] / cost[ceiling_k]

    # the anchor: llama-cpp-python's own prompt-lookup decoding on (a)
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    anchor = {}
    for name, draft in (("plain", None), ("LlamaPromptLookupDecoding", LlamaPromptLookupDecoding(num_pred_tokens=4))):
        llm = Llama(model_path=str(find_packaged()["smollm2-135m"]), n_ctx=2048, flash_attn=True, verbose=False,
                    logits_all=draft is not None, draft_model=draft)
        times = []
        for _ in range(args.runs):
            llm.reset()
            first, n = None, 0
            for chunk in llm.create_chat_completion(messages=[{"role": "user", "content": TASKS["(a) repeat a function"]}],
                                                    max_tokens=200, temperature=0, stream=True):
                if chunk["choices"][0]["delta"].get("content"):
                    n += 1
                    first = first or time.perf_counter()
            times.append((n - 1) / (time.perf_counter() - first) if first and n > 1 else float("nan"))
        anchor[name] = med(times)
        del llm

    print("\nSmolLM2-135M Q4_1 on two CPU cores, greedy, 200 tokens")
    print(f"verification cost t(k) in ms: {cost}; ceiling (k+1) x t(0) / t(k) = {ceiling:.2f}x at k={ceiling_k}")
    print(f"{'task':24} {'mode':6} {'decode tok/s':>13} {'vs off':>7} {'accepted':>9} {'drafted':>8}")
    base = {}
    for task, mode, tps, acc, drafted in rows:
        base.setdefault(task, tps)
        print(f"{task:24} {mode:6} {tps:13.1f} {tps / base[task]:7.2f} {acc:9.0%} {drafted:8d}")
    print(f"anchor on (a): llama-cpp-python LlamaPromptLookupDecoding {anchor['LlamaPromptLookupDecoding']:.1f} tok/s "
          f"vs its plain decoding {anchor['plain']:.1f} "
          f"({anchor['LlamaPromptLookupDecoding'] / anchor['plain']:.2f}x)")


if __name__ == "__main__":
    main()
