"""llmd against llama.cpp's own llama-server, path by path, in the fast and the exact policy.

With --model PATH [--draft PATH] (e.g. Qwen2.5-Coder-1.5B and its 0.5B sibling, from
scripts/fetch_models.py) the peers are llama-server plain, llama-server with the draft model
(--spec-type draft-simple --model-draft) and llama-server with n-gram speculation (ngram-simple),
against llmd with its defaults, as users run it (automatic context and threads, the draft
registered beside the model, so llmd pairs it by itself; the header says what it chose), and with
--ctx4096 also llmd with LLMD_CTX=4096 as a second, labelled column; the table adds a code-edit row
(most of the answer repeats the prompt) and gives llmd against the plain server and against the
best peer on each row.

Builds or finds llama-server with ../shared/tools/build-llama-server.sh (same llama.cpp as
llama-cpp-python), starts each system alone on a free port with the same model (on the packaged SmolLM2: the same
threads, slots and context, -np 4 -c 16384 -t 2 vs LLMD_SLOTS=4 LLMD_CTX=4096 LLMD_THREADS=2), runs every path a
few rounds (waiting for llmd's idle work between requests, so it never slows what is measured),
and prints medians with the ratio llmd / llama-server. Tokens are counted from each server's
`usage`. On a CPU with AMX, llama-server runs with --no-repack (it segfaults otherwise).

    python benchmarks/vs_llama_server.py [--rounds 3]
    python benchmarks/vs_llama_server.py --model QWEN_1.5B.gguf --draft QWEN_0.5B.gguf [--ctx4096] [--paths shared_prefix]
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
from _harness import ROOT, cpu_name, free_port, med, start_llmd, start_llmd_with, stop, wait_http, wait_idle  # noqa: E402

THREADS = "2"
# a quiet moment before each measured request: llama.cpp's threads poll for work for a while after
# a batch, so the system measured just before can still hold the cores
SETTLE_S = 0.25
WORDS = ("lighthouse keeper harbour storm lantern rope tide gull cliff beacon ship fog bell signal wave "
         "stone stair window night morning oil wick glass island coast current anchor sail cargo").split()


def text_of(n_words: int, seed: int) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(n_words))


class Peer:
    """One running system: an OpenAI-compatible base URL, and how to wait until it is idle."""

    def __init__(self, name: str, url: str, idle: Callable[[], None], model: str = "smollm2-135m") -> None:
        self.name, self.url, self.idle, self.model = name, url, idle, model
        self.prefilled = -1
        # a fresh connection per request: llama-server may close a kept-alive one as the next request goes out
        self.http = httpx.Client(timeout=600, limits=httpx.Limits(max_keepalive_connections=0))

    def stream(self, messages: list[dict], max_tokens: int, **extra: object) -> tuple[float, float, int, int, str]:
        """(ttft s, decode tok/s, completion tokens, prompt tokens, text); tokens from usage. Also
        sets .prefilled: prompt tokens the server computed (llama-server's timings.prompt_n, llmd's
        prompt_tokens - cached_tokens)."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
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
        time.sleep(SETTLE_S)
        return self.stream(messages, max_tokens, **extra)[0]


SYS = {"role": "system", "content": "You are a helpful assistant. Answer briefly and clearly."}
QUESTIONS = ["What is a lighthouse for?", "Why is the sea salty?", "How do tides work?", "What makes fog?",
             "Name a famous harbour.", "Why do gulls follow ships?"]


def short_chat(p: Peer, r: int, tag: int) -> dict[str, float]:
    """The median of three short chats (one 15-token prefill each, whose time moved 0.2-0.8 s
    from one request to the next on this shared machine). Round 0 is left out of the median
    (run_paths adds a round): a system's first short chat after a load can be cold in ways that
    say nothing of the path (its system prompt not cached)."""
    got = [p.ttft([SYS, {"role": "user", "content": f"{QUESTIONS[(3 * r + i) % 6]} ({tag}{r}.{i})"}]) for i in range(3)]
    return {"short chat TTFT (s)": med(got)}


def story(p: Peer, r: int, tag: int) -> dict[str, float]:
    p.idle()
    return {"decode tok/s (200-token story)": p.stream(
        [{"role": "user", "content": f"Write a long story about a lighthouse keeper number {tag}{r}."}], 200)[1]}


FUNCTION = """def summarize_orders(orders, tax_rate, discount_threshold):
    total = 0.0
    count = 0
    largest = None
    for order in orders:
        amount = order["quantity"] * order["unit_price"]
        if amount > discount_threshold:
            amount = amount * 0.95
        amount = amount * (1 + tax_rate)
        total = total + amount
        count = count + 1
        if largest is None or amount > largest:
            largest = amount
    if count == 0:
        return {"total": 0.0, "count": 0, "average": 0.0, "largest": None}
    average = total / count
    return {"total": round(total, 2), "count": count, "average": round(average, 2), "largest": largest}
"""


def code_edit(p: Peer, r: int, tag: int) -> dict[str, float]:
    """Most of the answer repeats the prompt: n-gram lookup and a draft model both have much to gain."""
    p.idle()
    ask = (f"Rename the variable `amount` to `order_total` in this function (request {tag}-{r}). "
           f"Reply with the whole function only.\n\n{FUNCTION}")
    return {"decode tok/s, code edit (~300 tokens)": p.stream([{"role": "user", "content": ask}], 400)[1]}


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


PATHS: list[Callable[[Peer, int, int], dict[str, float]]] = [short_chat, story, code_edit, cold, shared_prefix,
                                                              multi_turn, four_clients, same_again]


def run_paths(peers: list[Peer], rounds: int, paths: list[Callable] = PATHS) -> dict[str, dict[str, float]]:
    """Every path, round by round, the systems taking turns within each round (one at a time: the
    others are idle), so this machine's slow spells hit all of them alike. Medians per system."""
    got: dict[str, dict[str, list[float]]] = {p.name: {} for p in peers}
    for p in peers:  # first contact: loads, warm-ups
        p.ttft([SYS, {"role": "user", "content": "Hello"}])
    for path in paths:
        skip = 1 if path is short_chat else 0
        for r in range(rounds + skip):
            for tag, p in enumerate(peers, 1):
                for k, v in path(p, r, tag).items():
                    if r >= skip:
                        got[p.name].setdefault(k, []).append(v)
        print(path.__name__, {n: {k: round(med(v), 3) for k, v in rows.items()} for n, rows in got.items()},
              file=sys.stderr, flush=True)
    return {n: {k: med(v) for k, v in rows.items()} for n, rows in got.items()}


def llama_server(model: str = "", extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen | None, str, list[str]]:
    tool = ROOT.parent / "shared" / "tools" / "build-llama-server.sh"
    if not tool.exists():
        tool = ROOT / "scripts" / "build-llama-server.sh"
    bin_dir = Path(subprocess.run(["bash", str(tool)], check=True, capture_output=True, text=True).stdout.strip())
    from llmd.models.catalog import find_packaged

    model = model or str(find_packaged(Path("/tmp"))["smollm2-135m"])
    amx = "amx_tile" in Path("/proc/cpuinfo").read_text()
    args = [str(bin_dir / "llama-server"), "-m", str(model), "-np", "4", "-c", "16384", "-t", THREADS,
            "--port", str(port := free_port()), "--host", "127.0.0.1", *(["--no-repack"] if amx else []), *extra]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc)
    while httpx.get(url + "/health").status_code != 200:
        time.sleep(0.2)
    return proc, url, args


def warm_row(url: str, rounds: int, model: str = "smollm2-135m") -> tuple[float, float]:
    """(cold TTFT, TTFT after POST /llmd/warm of the conversation so far) on a ~1,950-token prompt:
    an app warms the cache while its user is still typing the question."""
    p = Peer("llmd", url, lambda: wait_idle(url), model)
    cold, warm = [], []
    for r in range(rounds):
        doc = f"[warm-{r}] " + text_of(1600, 500 + r)
        cold.append(p.ttft([{"role": "user", "content": doc + "\nQuestion: what is this about?"}]))
        doc2 = f"[warm2-{r}] " + text_of(1600, 600 + r)
        p.idle()
        p.http.post(url + "/llmd/warm", json={"model": model, "messages": [{"role": "user", "content": doc2}]}
                    ).raise_for_status()
        warm.append(p.ttft([{"role": "user", "content": doc2 + "\nQuestion: what is this about?"}]))
    return med(cold), med(warm)


def restart_row(models: dict[str, str] | None = None) -> tuple[float, float]:
    """(cold TTFT, TTFT after a restart from the disk prefix cache) on a ~2,000-token prompt; on a
    real model with llmd's defaults."""
    env = {} if models else {"LLMD_SLOTS": "4", "LLMD_CTX": "4096", "LLMD_THREADS": THREADS}
    model = next(iter(models)) if models else "smollm2-135m"
    proc, url, home = start_llmd_with(models, env) if models else start_llmd(env)
    p = Peer("llmd", url, lambda: wait_idle(url), model)
    doc = "[restart] " + text_of(1650, 7)
    cold = p.ttft([{"role": "user", "content": doc + "\nQuestion: what is this about?"}])
    p.idle()
    stop(proc)
    proc, url, _ = (start_llmd_with(models, env, home) if models
                    else start_llmd({**env, "LLMD_HOME": str(home)}))
    p = Peer("llmd", url, lambda: wait_idle(url), model)
    warm = p.ttft([{"role": "user", "content": doc + "\nQuestion: who wrote it?"}])
    stop(proc)
    return cold, warm


def real_model(args: argparse.Namespace) -> None:
    """The whole table on a real model: llmd with its defaults (the context and threads it chooses
    itself, as users run it) against three llama-server setups; with --ctx4096 also llmd with
    LLMD_CTX=4096, labelled, to tell what the automatic context costs."""
    name = Path(args.model).stem.lower()
    models = {name: args.model, **({Path(args.draft).stem.lower(): args.draft} if args.draft else {})}
    setups: list[tuple[str, tuple[str, ...]]] = [("server", ())]
    if args.draft and not args.paths:
        setups.append(("server+draft", ("--spec-type", "draft-simple", "--model-draft", args.draft)))
    if not args.paths:
        setups.append(("server+ngram", ("--spec-type", "ngram-simple")))
    variants = [("llmd", {})] + ([("llmd ctx4096", {"LLMD_CTX": "4096"})] if args.ctx4096 else [])
    procs: list[subprocess.Popen] = []
    try:
        llmds = []
        for label, env in variants:
            lp, lurl, _ = start_llmd_with(models, env)
            procs.append(lp)
            llmds.append((label, lurl))

        def all_idle() -> None:  # whoever is measured, no llmd may be busy with idle work meanwhile
            for _, u in llmds:
                wait_idle(u)

        peers = []
        for label, extra in setups:
            sp, surl, _ = llama_server(args.model, extra)
            procs.append(sp)  # type: ignore[arg-type]
            peers.append(Peer(label, surl, all_idle, name))
        peers += [Peer(label, u, all_idle, name) for label, u in llmds]
        chosen = [p for p in PATHS if p.__name__ in args.paths.split(",")] if args.paths else PATHS
        results = run_paths(peers, args.rounds, chosen)
        lurl = llmds[0][1]
        status = httpx.get(lurl + "/llmd/status", timeout=30).json()
        warm_cold, warm_warm = warm_row(lurl, args.rounds, name) if not args.paths else (0.0, 0.0)
    finally:
        for pr in procs:
            stop(pr)
    restart = [restart_row(models) for _ in range(args.rounds)] if not args.paths else []
    m = next(m for m in status["loaded"] if m["name"] == name)
    cpu = cpu_name()
    print(f"# llmd vs llama-server: {name}, {cpu}, {os.cpu_count()} CPUs, llama-server -np 4 -c 16384 -t {THREADS}; "
          f"medians of {args.rounds} rounds (the first, cold, round of short chat left out), the systems taking turns")
    print(f"# llmd with its defaults: {m.get('n_slots', '?')} slots x {m.get('n_ctx', '?')} tokens "
          f"({m.get('ctx_reason', '')}), threads auto (up to {m.get('threads', '?')}), attention "
          f"{m.get('attention', '?')} (llama-server: flash attention, its auto)")
    print(f"# llmd: draft {m.get('draft')} ({m.get('draft_reason')}); speculation measured live: "
          f"{(m.get('stats') or {}).get('speculation', {}).get('speedup')}")
    labels = [p.name for p in peers]
    n_server = len(setups)
    print(f"{'path':<46}" + "".join(f"{x:>13}" for x in labels) + f"{'llmd/server':>12}{'llmd/best':>10}")
    for row in results["server"]:
        values = [results[x][row] for x in labels]
        higher = "tok/s" in row
        best = max(values[:n_server]) if higher else min(values[:n_server])
        mine = values[n_server]
        print(f"{row:<46}" + "".join(f"{v:>13.3f}" for v in values)
              + f"{mine / values[0]:>12.2f}{mine / best:>10.2f}")
    if args.paths:
        return
    cold_s, warm_s = med([c for c, _ in restart]), med([w for _, w in restart])
    print(f"\nllmd, POST /llmd/warm while the user types (~1,950-token prompt): cold {warm_cold:.2f} s, "
          f"after warming {warm_warm:.3f} s, {warm_warm / warm_cold:.1%} of cold")
    print(f"llmd after a restart (disk prefix, ~2,000 tokens, new question): cold {cold_s:.2f} s, "
          f"restored {warm_s:.3f} s, {warm_s / cold_s:.1%} of cold")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default="", help="a GGUF to run the table on (default: the packaged SmolLM2)")
    ap.add_argument("--draft", default="", help="its draft model: llmd pairs it, llama-server gets --model-draft")
    ap.add_argument("--ctx4096", action="store_true", help="with --model: also llmd with LLMD_CTX=4096, labelled")
    ap.add_argument("--paths", default="", help="with --model: only these paths (comma-separated function names, "
                    "e.g. shared_prefix,four_clients), against plain llama-server, without the warm and restart rows")
    args = ap.parse_args()
    if args.model:
        return real_model(args)
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
    cpu = cpu_name()
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
