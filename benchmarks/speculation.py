"""Speculation against plain decoding, through llmd's API: n-gram lookup, the draft model, auto.

(a) an input-grounded task (repeat a ~150-token function) and (b) free chat, with two targets:
the shipped SmolLM2-135M Q4_1 (off, ngram, auto) and the same model re-encoded to F16, paired
with the Q4_1 as its draft model (off, ngram, draft, auto). Prints decode tokens/s, the ratio
to off, and the acceptance rate; the ceiling on this machine for each target, (k+1) x t(0) /
t(k) for the best k (verifying k drafts is not free on a CPU); and llama-cpp-python's
LlamaPromptLookupDecoding on (a) as the anchor.

    python benchmarks/speculation.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
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


def measure(url: str, model: str, modes: tuple[str, ...], runs: int) -> list[tuple[str, str, float, float, int]]:
    """Modes take turns run by run, so a slow spell of this shared machine hits them all alike."""
    rows = []
    for task, prompt in TASKS.items():
        tps: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(runs):
            for mode in modes:
                wait_idle(url)
                tps[mode].append(stream_openai_chat(url, body(model, prompt, mode)).decode_tps)
        for mode in modes:
            wait_idle(url)
            d = httpx.post(url + "/v1/chat/completions", timeout=300, json=body(model, prompt, mode)).json()[
                "usage"]["completion_tokens_details"]
            drafted = d["accepted_prediction_tokens"] + d["rejected_prediction_tokens"]
            rows.append((task, mode, med(tps[mode]),
                         d["accepted_prediction_tokens"] / drafted if drafted else float("nan"), drafted))
    return rows


def body(model: str, prompt: str, mode: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 200, "temperature": 0,
            "speculation": mode, "cache_prompt": False}


def warm(url: str, model: str, mode: str) -> None:
    """The engine measures t(k) once it is idle after its first speculating request."""
    stream_openai_chat(url, {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                             "speculation": mode})
    wait_idle(url)


def ceiling(spec: dict) -> tuple[dict[int, float], int, float]:
    cost = {int(k): v for k, v in spec["verify_cost_ms"].items()}
    k = max(cost, key=lambda k: (k + 1) * cost[0] / cost[k])
    return cost, k, (k + 1) * cost[0] / cost[k]


def draft_gain(cost: dict[int, float], dm: dict, p: float, k: int) -> float:
    """Expected speed-up of drafting k tokens with the draft model at acceptance p."""
    ks = sorted(cost)
    lo, hi = max(x for x in ks if x <= k), min(x for x in ks if x >= k)
    t_k = cost[lo] if lo == hi else cost[lo] + (cost[hi] - cost[lo]) * (k - lo) / (hi - lo)
    expected = sum(p**i for i in range(k + 1))
    return expected * cost[0] / (t_k + k * dm["step_ms"] + dm["catchup_ms"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    proc, url, home = start_llmd({"LLMD_SLOTS": "1", "LLMD_RESPONSE_CACHE": "0", "LLMD_MAX_LOADED": "2",
                                   "LLMD_KEEP_ALIVE": "-1"})
    env = {**os.environ, "LLMD_HOME": str(home), "LLMD_PORT": url.rsplit(":", 1)[1]}
    try:
        warm(url, "smollm2-135m", "ngram")
        q4 = measure(url, "smollm2-135m", ("off", "ngram", "auto"), args.runs)
        subprocess.run([sys.executable, "-m", "llmd", "quantize", "smollm2-135m", "--type", "F16", "--name",
                        "smollm2-f16"], env=env, check=True, capture_output=True)
        subprocess.run([sys.executable, "-m", "llmd", "models", "pair", "smollm2-f16", "smollm2-135m"], env=env,
                       check=True, capture_output=True)
        warm(url, "smollm2-f16", "draft")
        f16 = measure(url, "smollm2-f16", ("off", "ngram", "draft", "auto"), args.runs)
        stats = {m["name"]: m["stats"] for m in httpx.get(url + "/llmd/status").json()["loaded"]}
    finally:
        stop(proc)

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

    for title, model, rows in (("SmolLM2-135M Q4_1", "smollm2-135m", q4),
                               ("SmolLM2-135M F16 target, Q4_1 draft model", "smollm2-f16", f16)):
        spec = stats[model]["speculation"]
        cost, k, ceil = ceiling(spec)
        print(f"\n{title} on two CPU cores, greedy, 200 tokens")
        print(f"verification cost t(k) in ms: {cost}; ceiling (k+1) x t(0) / t(k) = {ceil:.2f}x at k={k}")
        if spec.get("draft_model"):
            dm = spec["draft_model"]
            print(f"draft model: {dm['step_ms']:.1f} ms per drafted token, {dm['catchup_ms']:.1f} ms per accepted "
                  "token it catches up on (timed beside the target)")
            for task, mode, _, acc, _ in rows:
                if mode == "draft":
                    best = max(range(1, 9), key=lambda k: draft_gain(cost, dm, acc, k))
                    print(f"  draft-model ceiling on {task} at its {acc:.0%} acceptance: "
                          f"{draft_gain(cost, dm, acc, best):.2f}x at k={best} "
                          "(E(k) x t(0) / (t(k) + k x step + catch-up))")
        print(f"{'task':24} {'mode':6} {'decode tok/s':>13} {'vs off':>7} {'accepted':>9} {'drafted':>8}")
        base: dict[str, float] = {}
        for task, mode, tps, acc, drafted in rows:
            base.setdefault(task, tps)
            print(f"{task:24} {mode:6} {tps:13.1f} {tps / base[task]:7.2f} {acc:9.0%} {drafted:8d}")
    print(f"\nanchor on (a): llama-cpp-python LlamaPromptLookupDecoding {anchor['LlamaPromptLookupDecoding']:.1f} "
          f"tok/s vs its plain decoding {anchor['plain']:.1f} "
          f"({anchor['LlamaPromptLookupDecoding'] / anchor['plain']:.2f}x)")


if __name__ == "__main__":
    main()
