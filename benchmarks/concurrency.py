"""Concurrent streaming clients: llmd's batched slots against llmd with one slot (serial) and
llama-cpp-python's server (--interrupt_requests False, so it queues instead of cutting streams).

    python benchmarks/concurrency.py [--tokens 100] [--levels 1,2,4,8] [--no-server]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.util
import os
import subprocess
import sys
import time
import uuid

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Sample, free_port, start_llmd, stop, stream_openai_chat, wait_http, wait_idle  # noqa: E402

from llmd.models.catalog import find_packaged  # noqa: E402

TOPICS = ["cats", "rain", "gravity", "rivers", "prime numbers", "sunsets", "bees", "rice", "volcanoes", "trains"]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_level(url: str, n: int, tokens: int) -> tuple[float, float, float]:
    """n clients at once, each with its own prompt: (aggregate tok/s, TTFT p50, TTFT p95)."""
    tag = uuid.uuid4().hex[:6]
    bodies = [{"messages": [{"role": "user", "content": f"[{tag}-{i}] Write a long essay about {TOPICS[i % 10]}."}],
               "max_tokens": tokens, "temperature": 0} for i in range(n)]
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(n) as pool:
        samples: list[Sample] = list(pool.map(lambda b: stream_openai_chat(url, b, httpx.Client(timeout=900)), bodies))
    wall = time.perf_counter() - t0
    total = sum(s.tokens for s in samples)
    ttfts = [s.ttft_s for s in samples]
    return total / wall, percentile(ttfts, 0.5), percentile(ttfts, 0.95)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--no-server", action="store_true")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]

    # one system at a time: two llama.cpp processes with busy-waiting threads on the same cores
    # would slow each other down and say nothing about either
    def start_llama_cpp_python() -> tuple[subprocess.Popen, str]:
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(find_packaged()["smollm2-135m"]),
             "--port", str(port), "--n_ctx", "4096", "--flash_attn", "true", "--interrupt_requests", "False",
             "--verbose", "false"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_http(f"http://127.0.0.1:{port}/v1/models", server)
        return server, f"http://127.0.0.1:{port}"

    starters = {
        "llmd (batched)": lambda: start_llmd({"LLMD_SLOTS": str(max(levels)), "LLMD_CTX": "1024"})[:2],
        "llmd, 1 slot (serial)": lambda: start_llmd({"LLMD_SLOTS": "1", "LLMD_CTX": "1024"})[:2],
    }
    if not args.no_server and importlib.util.find_spec("sse_starlette") is not None:
        starters["llama-cpp-python server"] = start_llama_cpp_python
    systems = list(starters)
    results: dict[tuple[str, int], tuple[float, float, float]] = {}
    for name, start in starters.items():
        proc, url = start()
        is_llmd = name.startswith("llmd")
        try:
            stream_openai_chat(url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            for n in levels:
                if is_llmd:
                    wait_idle(url)
                results[(name, n)] = run_level(url, n, args.tokens)
        finally:
            stop(proc)

    print(f"\nSmolLM2-135M Q4_1, {args.tokens} tokens per client, greedy, each client its own prompt")
    print(f"{'clients':>7} {'system':28} {'agg tok/s':>10} {'TTFT p50 s':>11} {'TTFT p95 s':>11}")
    for n in levels:
        for name in systems:
            tps, p50, p95 = results[(name, n)]
            print(f"{n:7d} {name:28} {tps:10.1f} {p50:11.2f} {p95:11.2f}")
    for n in levels:
        b = results[("llmd (batched)", n)]
        s = results[("llmd, 1 slot (serial)", n)]
        line = f"{n} clients: llmd/serial tok/s {b[0] / s[0]:.2f}x, p95 TTFT {b[2] / s[2]:.2f} of serial"
        if ("llama-cpp-python server", n) in results:
            c = results[("llama-cpp-python server", n)]
            line += f"; vs llama-cpp-python server tok/s {b[0] / c[0]:.2f}x, p95 TTFT {b[2] / c[2]:.2f}"
        print(line)
    print("targets at 4 clients: p95 TTFT <= 0.20 of serial, aggregate tok/s >= 1.2x serial")


if __name__ == "__main__":
    main()
