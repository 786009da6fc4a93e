"""What llmd's daemon, HTTP and IPC cost over llama.cpp itself.

The same greedy chat generation of up to 200 tokens (a) streamed through llmd's HTTP API,
(b) in-process with llama-cpp-python's Llama.create_chat_completion, (c) through
llama-cpp-python's own server; runs interleaved, several each. Each run opens a new
conversation (a unique system line) so no engine reuses a previous prompt.

    python benchmarks/overhead.py [--runs 5] [--tokens 200] [--no-server]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
import uuid

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (  # noqa: E402
    Sample,
    free_port,
    from_times,
    med,
    start_llmd,
    stop,
    stream_openai_chat,
    wait_http,
    wait_idle,
)

from llmd.backends.llamacpp.context import physical_cores  # noqa: E402
from llmd.models.catalog import find_packaged  # noqa: E402

USER = "Write a detailed story about a lighthouse keeper and a storm, with many events."


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"Session {uuid.uuid4().hex[:8]}-{i}. You are a helpful storyteller."},
            {"role": "user", "content": USER}]


def run_inprocess(llm, msgs: list[dict[str, str]], tokens: int) -> Sample:
    arrivals: list[float] = []
    pieces: list[str] = []
    t0 = time.perf_counter()
    for chunk in llm.create_chat_completion(messages=msgs, max_tokens=tokens, temperature=0.0, stream=True):
        piece = chunk["choices"][0]["delta"].get("content")
        if piece:
            arrivals.append(time.perf_counter())
            pieces.append(piece)
    return from_times(t0, arrivals, "".join(pieces))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--no-server", action="store_true", help="skip (c), llama-cpp-python's server")
    args = ap.parse_args()

    from llama_cpp import Llama

    model = str(find_packaged()["smollm2-135m"])
    threads = physical_cores()
    have_server = not args.no_server and importlib.util.find_spec("sse_starlette") is not None
    if not args.no_server and not have_server:
        print("(c) skipped: install it with  pip install 'llama-cpp-python[server]'")

    llmd_proc, llmd_url, _ = start_llmd({"LLMD_SLOTS": "1"})
    server = None
    server_url = ""
    if have_server:
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", model, "--port", str(port), "--n_ctx", "4096",
             "--n_threads", str(threads), "--flash_attn", "true", "--verbose", "false"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        server_url = f"http://127.0.0.1:{port}"
        wait_http(server_url + "/v1/models", server)
    llm = Llama(model_path=model, n_ctx=4096, n_threads=threads, flash_attn=True, verbose=False)

    results: dict[str, list[Sample]] = {"llmd": [], "in-process": [], "llama-cpp-python server": []}
    client = httpx.Client(timeout=600)
    try:
        # one warm-up each, not counted
        stream_openai_chat(llmd_url, {"messages": messages(-1), "max_tokens": 8, "temperature": 0}, client)
        wait_idle(llmd_url)
        run_inprocess(llm, messages(-1), 8)
        if server:
            stream_openai_chat(server_url, {"messages": messages(-1), "max_tokens": 8, "temperature": 0}, client)
        for i in range(args.runs):
            body = {"messages": messages(i), "max_tokens": args.tokens, "temperature": 0}
            results["llmd"].append(stream_openai_chat(llmd_url, body, client))
            wait_idle(llmd_url)  # llmd's background re-prefill must not slow the next system down
            llm.reset()
            results["in-process"].append(run_inprocess(llm, body["messages"], args.tokens))
            if server:
                results["llama-cpp-python server"].append(stream_openai_chat(server_url, body, client))
    finally:
        stop(llmd_proc)
        if server:
            stop(server)

    print(f"\nSmolLM2-135M Q4_1, greedy, up to {args.tokens} tokens, {args.runs} interleaved runs, {threads} threads")
    print(f"{'':26} {'decode tok/s':>13} {'TTFT ms':>9} {'tokens':>7}")
    summary = {}
    for name, samples in results.items():
        if not samples:
            continue
        tps = med([s.decode_tps for s in samples])
        ttft = med([s.ttft_s for s in samples]) * 1000
        summary[name] = (tps, ttft)
        print(f"{name:26} {tps:13.1f} {ttft:9.1f} {med([s.tokens for s in samples]):7.0f}")
    a_tps, a_ttft = summary["llmd"]
    b_tps, b_ttft = summary["in-process"]
    print(f"\nllmd / in-process decode tok/s: {a_tps / b_tps:.3f}   (target >= 0.97)")
    print(f"llmd - in-process TTFT (median): {a_ttft - b_ttft:+.1f} ms   (target <= +5 ms)")
    if "llama-cpp-python server" in summary:
        c_tps, c_ttft = summary["llama-cpp-python server"]
        print(f"llmd / llama-cpp-python server decode tok/s: {a_tps / c_tps:.3f}   (target >= 1.0)")
        print(f"llmd / llama-cpp-python server TTFT: {a_ttft / c_ttft:.3f}")
    same = results["llmd"][0].text == results["in-process"][0].text
    print(f"greedy text identical llmd vs in-process (run 1): {same}")


if __name__ == "__main__":
    main()
