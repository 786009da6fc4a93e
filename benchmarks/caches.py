"""What llmd's caches buy.

1. Response cache: p50 latency of a hit through HTTP against the miss that made it (100 tokens).
2. Prefix cache: a ~1,500-token shared system prompt with different questions: TTFT cold, warm in
   the slot, and warm from disk after a daemon restart.
3. Multi-turn chat: five turns with ~150-token replies and a 2 s pause between turns: TTFT of
   each turn, against llama.cpp's llama-server (built by ../shared/tools/build-llama-server.sh;
   skipped when it is not built).

    python benchmarks/caches.py [--skip-multiturn]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import free_port, med, start_llmd, stop, stream_openai_chat, wait_http  # noqa: E402

from llmd.models.catalog import find_packaged  # noqa: E402

FACTS = [
    "The lighthouse at Port Elspeth was first lit by keeper Agnes Morrow in 1821.",
    "Its lens was a first-order Fresnel lens made in Paris and shipped in forty crates.",
    "Keeper Elias Dunn rowed out twice during the storm of 1893 and saved nine sailors.",
    "The schooner Marigold broke apart on the Skerry Rocks after her anchor chain snapped.",
    "In 1907 a frost cracked the lens, and it was replaced the following spring.",
    "Tobias Wren switched on the electric beacon in 1954, ending the era of oil lamps.",
    "The clockwork that turned the light had to be wound every four hours through the night.",
    "Visitors can climb 154 steps to the lantern room on clear days between May and September.",
]
NO_STORE = {"Cache-Control": "no-store"}
PEER_BIN = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llmd-peers/llama.cpp-0.3.36/build/bin"


def system_prompt(tokens: int = 1500) -> str:
    # about 20 tokens a fact: repeat the list with section numbers until long enough
    parts, i = [], 0
    while len(" ".join(parts)) < tokens * 4.3:
        parts.append(f"Section {i}: {FACTS[i % len(FACTS)]}")
        i += 1
    return "You are the museum's guide. Use these notes. " + " ".join(parts)


def bench_response_cache(url: str) -> None:
    body = {"messages": [{"role": "user", "content": "Write a short story about a lighthouse cat."}],
            "max_tokens": 100, "temperature": 0}
    c = httpx.Client(timeout=300)
    t0 = time.perf_counter()
    r = c.post(url + "/v1/chat/completions", json=body)
    miss = time.perf_counter() - t0
    assert r.headers["X-LLMD-Cache"] == "miss", r.headers
    hits = []
    for _ in range(50):
        t0 = time.perf_counter()
        r = c.post(url + "/v1/chat/completions", json=body)
        hits.append(time.perf_counter() - t0)
        assert r.headers["X-LLMD-Cache"] == "hit"
    hit = med(hits)
    print(f"\n1. response cache ({r.json()['usage']['completion_tokens']}-token reply)")
    print(f"   miss {miss * 1000:.0f} ms, hit p50 {hit * 1000:.2f} ms: {miss / hit:.0f}x faster "
          "(target: hit <= 5 ms and >= 100x)")


def ttft(url: str, messages: list[dict], headers: dict | None = None) -> tuple[float, int]:
    s = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", headers=headers or NO_STORE, timeout=900,
                   json={"messages": messages, "max_tokens": 1, "temperature": 0})
    return time.perf_counter() - s, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def bench_prefix_cache(env: dict[str, str]) -> None:
    sys_msg = {"role": "system", "content": system_prompt()}
    qs = ["Who lit the first lamp?", "What happened in 1907?", "How many steps are there?",
          "Who saved the sailors?"]
    proc, url, home = start_llmd(env)
    try:
        cold, _ = ttft(url, [sys_msg, {"role": "user", "content": qs[0]}], {**NO_STORE})
        warm_slot, cached_slot = ttft(url, [sys_msg, {"role": "user", "content": qs[1]}])
        deadline = time.monotonic() + 120  # let the idle slot save its prefix
        while httpx.get(url + "/llmd/cache").json()["prefixes"]["entries"] == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        stop(proc)
    proc, url, home = start_llmd({**env, "LLMD_HOME": str(home)})
    try:
        warm_disk, cached_disk = ttft(url, [sys_msg, {"role": "user", "content": qs[2]}])
        n_prompt = httpx.post(url + "/v1/chat/completions", headers=NO_STORE, timeout=900, json={
            "messages": [sys_msg, {"role": "user", "content": qs[3]}], "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    finally:
        stop(proc)
    print(f"\n2. prefix cache ({n_prompt}-token prompt, different questions)")
    print(f"   cold TTFT {cold:.2f} s; warm in slot {warm_slot:.2f} s ({cached_slot} cached); "
          f"warm from disk after restart {warm_disk:.2f} s ({cached_disk} cached)")
    print(f"   from disk / cold = {warm_disk / cold:.1%} (target <= 5%); in slot / cold = {warm_slot / cold:.1%}")


def conversation(url: str, turns: int = 5, reply_tokens: int = 150, pause: float = 2.0,
                 extra: dict | None = None) -> list[float]:
    messages = [{"role": "system", "content": "You are a friendly guide to the lighthouse museum."}]
    asks = ["Tell me about the lighthouse.", "Who were its keepers?", "What about storms?",
            "How did the lens work?", "What can visitors see today?"]
    out = []
    for i in range(turns):
        messages.append({"role": "user", "content": asks[i % len(asks)]})
        s = stream_openai_chat(url, {"messages": messages, "max_tokens": reply_tokens, "temperature": 0,
                                     **(extra or {})})
        out.append(s.ttft_s)
        messages.append({"role": "assistant", "content": s.text})
        time.sleep(pause)
    return out


def bench_multiturn(env: dict[str, str]) -> None:
    proc, url, _ = start_llmd(env)
    try:
        ours = conversation(url, extra={})
    finally:
        stop(proc)
    server = PEER_BIN / "llama-server"
    print("\n3. multi-turn chat, TTFT per turn (s)")
    print("   llmd:         " + "  ".join(f"{t:.2f}" for t in ours))
    if not server.exists():
        print(f"   llama-server: not built ({server}); run ../shared/tools/build-llama-server.sh")
        return
    port = free_port()
    peer = subprocess.Popen([str(server), "-m", str(find_packaged()["smollm2-135m"]), "--port", str(port),
                             "-c", "4096", "-np", "1", "-fa", "on"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", peer)
        theirs = conversation(f"http://127.0.0.1:{port}")
    finally:
        stop(peer)
    print("   llama-server: " + "  ".join(f"{t:.2f}" for t in theirs))
    print("   llmd / llama-server per turn: " + "  ".join(f"{a / b:.2f}" for a, b in zip(ours, theirs, strict=True))
          + "   (target <= 1.0 each)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-multiturn", action="store_true")
    args = ap.parse_args()
    env = {"LLMD_SLOTS": "1"}
    proc, url, home = start_llmd(env)
    try:
        bench_response_cache(url)
    finally:
        stop(proc)
        shutil.rmtree(home, ignore_errors=True)
    bench_prefix_cache(env)
    if not args.skip_multiturn:
        bench_multiturn(env)


if __name__ == "__main__":
    main()
