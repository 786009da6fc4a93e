"""Switching models: time from a switch request to the first token of the other model, against
loading that model cold in a fresh process (import llama-cpp-python, load, first token).

    python benchmarks/switch.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import med, start_llmd, stop, stream_openai_chat  # noqa: E402

COLD = """
import sys, time
t0 = float(sys.argv[2])
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=4096, flash_attn=True, verbose=False)
for _ in llm.create_chat_completion(messages=[{"role": "user", "content": "Hi"}], max_tokens=1, stream=True):
    pass
print(time.time() - t0)
"""


def cold_load(path: str) -> float:
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", COLD, path, repr(t0)], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def switch(url: str, token: str, model: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(url + "/llmd/models/active", json={"model": model}, timeout=300,
                   headers={"Authorization": f"Bearer {token}"})
    r.raise_for_status()
    stream_openai_chat(url, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    proc, url, home = start_llmd({"LLMD_SLOTS": "1"})
    token = (home / "config" / "token").read_text().strip()
    models = {m["name"]: m["path"] for m in httpx.get(url + "/llmd/models").json()["models"]}
    if "gemma3-270m" not in models:
        stop(proc)
        sys.exit("gemma3-270m is not registered: pip install 'llmd[gemma]'")
    results: dict[str, dict[str, list[float]]] = {}
    try:
        for _ in range(args.runs):
            for target in ("gemma3-270m", "smollm2-135m"):
                r = results.setdefault(target, {"switch": [], "cold": []})
                r["switch"].append(switch(url, token, target))
                r["cold"].append(cold_load(models[target]))
    finally:
        stop(proc)
    print(f"\nswitch request -> first token of the other model, vs a cold load in a fresh process ({args.runs} runs)")
    print(f"{'to':14} {'switch s':>9} {'cold s':>8} {'ratio':>6}")
    for target, r in results.items():
        sw, cold = med(r["switch"]), med(r["cold"])
        print(f"{target:14} {sw:9.2f} {cold:8.2f} {sw / cold:6.2f}")
    print("target: switch <= 1.2x cold load")


if __name__ == "__main__":
    main()
