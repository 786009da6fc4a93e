"""llmd against llama.cpp's own llama-server, path by path, in the fast and the exact policy.

Builds or finds llama-server with ../shared/tools/build-llama-server.sh (same llama.cpp as
llama-cpp-python), starts each system alone on a free port with the same model, threads, slots
and context (-np 4 -c 16384 -t 2 vs LLMD_SLOTS=4 LLMD_CTX=4096 LLMD_THREADS=2), runs every path a
few rounds (waiting for llmd's idle work between requests, so it never slows what is measured),
and prints medians with the ratio llmd / llama-server. Tokens are counted from each server's
`usage`. On a CPU with AMX, llama-server runs with --no-repack (it segfaults otherwise).

    python benchmarks/vs_llama_server.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import ROOT, free_port, med, start_llmd, stop, wait_http, wait_idle  # noqa: E402

THREADS = "2"
WORDS = ("lighthouse keeper harbour storm lantern rope tide gull cliff beacon ship fog bell signal wave "
         "stone stair window night morning oil wick glass island coast current anchor sail cargo").split()


def text_of(n_words: int, seed: int) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(n_words))


class Peer:
    """One running system: an OpenAI-compatible base URL, and how to wait until it is idle."""

    def __init__(self, name: str, url: str, idle: Callable[[], None]) -> None:
        self.name, self.url, self.idle = name, url, idle
        self.prefilled = -1
        # a fresh connection per request: llama-server may close a kept-alive one as the next request goes out
        self.http = httpx.Client(timeout=600, limits=httpx.Limits(max_keepalive_connections=0))

    def stream(self, messages: list[dict], max_tokens: int, **extra: object) -> tuple[float, float, int, int, str]:
        """(ttft s, decode tok/s, completion tokens, prompt tokens, text); tokens from usage. Also
        sets .prefilled: prompt tokens the server computed (llama-server's timings.prompt_n, llmd's
        prompt_tokens - cached_tokens)."""
        body = {"model": "smollm2-135m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, **extra}
        t0 = time.perf_counter()
        first = last = 0.0
        usage: dict = {}
        pieces: list[str] = []
        with self.http.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                if "prompt_n" in (chunk.get("timings") or {}):
                    self.prefilled = int(chunk["timings"]["prompt_n"])
                for ch in chunk.get("choices", []):
                    if (ch.get("delta") or {}).get("content"):
                        pieces.append(ch["delta"]["content"])
                        last = time.perf_counter()
                        first = first or last
        n = int(usage.get("completion_tokens", 0))
        if "prompt_tokens_details" in usage and usage["prompt_tokens_details"] is not None:
            self.prefilled = int(usage["prompt_tokens"]) - int(usage["prompt_tokens_details"].get("cached_tokens") or 0)
        tps = (n - 1) / (last - first) if n > 1 and last > first else float("nan")
        return first - t0, tps, n, int(usage.get("prompt_tokens", 0)), "".join(pieces)

    def ttft(self, messages: list[dict], max_tokens: int = 8, **extra: object) -> float:
        self.idle()
        return self.stream(messages, max_tokens, **extra)[0]


SYS = {"role": "system", "content": "You are a helpful assistant. Answer briefly and clearly."}
QUESTIONS = ["What is a lighthouse for?", "Why is the sea salty?", "How do tides work?", "What makes fog?",
             "Name a famous harbour.", "Why do gulls follow ships?"]


def short_chat(p: Peer, r: int, tag: int) -> dict[str, float]:
    p.idle()
    return {"short chat TTFT (s)": p.ttft([SYS, {"role": "user", "content": f"{QUESTIONS[r % 6]} ({tag}{r})"}])}


def story(p: Peer, r: int, tag: int) -> dict[str, float]:
    p.idle()
    return {"decode tok/s (200-token story)": p.stream(
        [{"role": "user", "content": f"Write a long story about a lighthouse keeper number {tag}{r}."}], 200)[1]}


def cold(p: Peer, r: int, tag: int) -> dict[str, float]:
    p.idle()
    ttft, _, _, n_prompt, _ = p.stream([{"role": "user", "content": f"[{tag}-{r}] " + text_of(1000, tag * 100 + r)
                                         + "\nSummarise this."}], 4)
    return {"cold ~1,200-token prompt TTFT (s)": ttft, "  cold prefill tok/s": n_prompt / ttft}


def shared_prefix(p: Peer, r: int, tag: int) -> dict[str, float]:
    doc = f"[{tag}-{r}] " + text_of(1600, tag * 1000 + r)
    p.idle()
    p.ttft([{"role": "user", "content": doc + "\nQuestion: what is this about?"}])
    return {"warm shared prefix (~1,950 tokens) TTFT (s)":
            p.ttft([{"role": "user", "content": doc + f"\nQuestion: {QUESTIONS[r % 6]}"}])}


def multi_turn(p: Peer, r: int, tag: int) -> dict[str, float]:
    convo, turns, computed = [SYS], [], []
    for i, q in enumerate(["Tell me about lighthouses.", "Who keeps them?", "What did they eat?",
                           "How did they light the lamp?", "Were they lonely?", "Are any still staffed?"]):
        convo.append({"role": "user", "content": f"{q} ({tag}-{r})"})
        p.idle()
        ttft, _, _, _, reply = p.stream(convo, 60)
        if i:
            turns.append(ttft)
            computed.append(p.prefilled)
        convo.append({"role": "assistant", "content": reply})
    return {"multi-turn chat, turns 2-6 TTFT (s)": med(turns),
            "  prompt tokens computed per turn": med([float(c) for c in computed])}


def four_clients(p: Peer, r: int, tag: int) -> dict[str, float]:
    p.idle()
    msgs = [[{"role": "user", "content": f"Write about {w} ({tag}-{r})."}] for w in ("rain", "cats", "ships", "bread")]
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda m: p.stream(m, 100), msgs))
    wall = time.perf_counter() - t0
    return {"4 clients, slowest first token (s)": max(g[0] for g in got),
            "4 clients, aggregate tok/s": sum(g[2] for g in got) / wall}


def same_again(p: Peer, r: int, tag: int) -> dict[str, float]:
    same = [{"role": "user", "content": f"Name three colours. ({tag}-{r})"}]
    p.idle()
    p.stream(same, 30)
    return {"the same request again TTFT (s)": p.ttft(same, 30)}


PATHS: list[Callable[[Peer, int, int], dict[str, float]]] = [short_chat, story, cold, shared_prefix, multi_turn,
                                                              four_clients, same_again]


def run_paths(peers: list[Peer], rounds: int) -> dict[str, dict[str, float]]:
    """Every path, round by round, the systems taking turns within each round (one at a time: the
    others are idle), so this machine's slow spells hit all of them alike. Medians per system."""
    got: dict[str, dict[str, list[float]]] = {p.name: {} for p in peers}
    for p in peers:  # first contact: loads, warm-ups
        p.ttft([SYS, {"role": "user", "content": "Hello"}])
    for path in PATHS:
        for r in range(rounds):
            for tag, p in enumerate(peers, 1):
                for k, v in path(p, r, tag).items():
                    got[p.name].setdefault(k, []).append(v)
        print(path.__name__, {n: {k: round(med(v), 3) for k, v in rows.items()} for n, rows in got.items()},
              file=sys.stderr, flush=True)
    return {n: {k: med(v) for k, v in rows.items()} for n, rows in got.items()}


def llama_server() -> tuple[subprocess.Popen | None, str, list[str]]:
    tool = ROOT.parent / "shared" / "tools" / "build-llama-server.sh"
    bin_dir = Path(subprocess.run(["bash", str(tool)], check=True, capture_output=True, text=True).stdout.strip())
    from llmd.models.catalog import find_packaged

    model = find_packaged(Path("/tmp"))["smollm2-135m"]
    amx = "amx_tile" in Path("/proc/cpuinfo").read_text()
    args = [str(bin_dir / "llama-server"), "-m", str(model), "-np", "4", "-c", "16384", "-t", THREADS,
            "--port", str(port := free_port()), "--host", "127.0.0.1", *(["--no-repack"] if amx else [])]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc)
    while httpx.get(url + "/health").status_code != 200:
        time.sleep(0.2)
    return proc, url, args


def warm_row(url: str, rounds: int) -> tuple[float, float]:
    """(cold TTFT, TTFT after POST /llmd/warm of the conversation so far) on a ~1,950-token prompt:
    an app warms the cache while its user is still typing the question."""
    p = Peer("llmd", url, lambda: wait_idle(url))
    cold, warm = [], []
    for r in range(rounds):
        doc = f"[warm-{r}] " + text_of(1600, 500 + r)
        cold.append(p.ttft([{"role": "user", "content": doc + "\nQuestion: what is this about?"}]))
        doc2 = f"[warm2-{r}] " + text_of(1600, 600 + r)
        p.idle()
        p.http.post(url + "/llmd/warm", json={"messages": [{"role": "user", "content": doc2}]}).raise_for_status()
        warm.append(p.ttft([{"role": "user", "content": doc2 + "\nQuestion: what is this about?"}]))
    return med(cold), med(warm)


def restart_row() -> tuple[float, float]:
    """(cold TTFT, TTFT after a restart from the disk prefix cache) on a ~2,000-token prompt."""
    env = {"LLMD_SLOTS": "4", "LLMD_CTX": "4096", "LLMD_THREADS": THREADS}
    proc, url, home = start_llmd(env)
    p = Peer("llmd", url, lambda: wait_idle(url))
    doc = "[restart] " + text_of(1650, 7)
    cold = p.ttft([{"role": "user", "content": doc + "\nQuestion: what is this about?"}])
    p.idle()
    stop(proc)
    proc, url, _ = start_llmd({**env, "LLMD_HOME": str(home)})
    p = Peer("llmd", url, lambda: wait_idle(url))
    warm = p.ttft([{"role": "user", "content": doc + "\nQuestion: who wrote it?"}])
    stop(proc)
    return cold, warm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    env = {"LLMD_SLOTS": "4", "LLMD_CTX": "4096", "LLMD_THREADS": THREADS}
    procs: list[subprocess.Popen] = []
    try:
        proc, url, peer_args = llama_server()
        procs.append(proc)  # type: ignore[arg-type]
        llmd_urls: list[str] = []

        def all_idle() -> None:  # whoever is measured, no llmd may be busy with idle work meanwhile
            for u in llmd_urls:
                wait_idle(u)

        peers = [Peer("llama-server", url, all_idle)]
        for name, extra in (("llmd fast", {}), ("llmd exact", {"LLMD_EXACT": "1"})):
            lp, lurl, _ = start_llmd({**env, **extra})
            procs.append(lp)
            llmd_urls.append(lurl)
            peers.append(Peer(name, lurl, all_idle))
        results = run_paths(peers, args.rounds)
        warm_cold, warm_warm = warm_row(llmd_urls[0], args.rounds)
    finally:
        for pr in procs:
            stop(pr)
    restart = [restart_row() for _ in range(args.rounds)]
    cold_s, warm_s = med([c for c, _ in restart]), med([w for _, w in restart])
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    print(f"# llmd vs llama-server: SmolLM2-135M Q4_1, {cpu}, {os.cpu_count()} CPUs, threads {THREADS}, "
          f"medians of {args.rounds} rounds, the systems taking turns")
    print(f"# peer: {' '.join(Path(a).name if i == 0 else a for i, a in enumerate(peer_args))}")
    if "--no-repack" in peer_args:
        print("# this CPU has AMX: llama-server runs with --no-repack (its weight repacking segfaults here)")
    peer = results["llama-server"]
    print(f"{'path':<46} {'llama-server':>12} {'fast':>9} {'fast/peer':>9} {'exact':>9} {'exact/peer':>10}")
    for row, theirs in peer.items():
        f, e = results["llmd fast"][row], results["llmd exact"][row]
        print(f"{row:<46} {theirs:>12.3f} {f:>9.3f} {f / theirs:>9.2f} {e:>9.3f} {e / theirs:>10.2f}")
    print(f"\nllmd fast, POST /llmd/warm while the user types (~1,950-token prompt): cold {warm_cold:.2f} s, "
          f"after warming {warm_warm:.3f} s, {warm_warm / warm_cold:.1%} of cold")
    print(f"llmd fast after a restart (disk prefix, ~2,000 tokens, new question): cold {cold_s:.2f} s, "
          f"restored {warm_s:.3f} s, {warm_s / cold_s:.1%} of cold")


if __name__ == "__main__":
    main()
