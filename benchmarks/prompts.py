"""Cold prompts: how fast llmd reads a long prompt nothing can be reused for, against llama-server
and against llama-bench's best prompt rate on this machine (issue 51), and what llmd's idle work
after each answer costs the desktop.

Both systems serve the same GGUF, loaded before the first request: llmd with its defaults, as
users run it; llama-server with its defaults and the context the longest prompt needs (`-c`;
`--no-repack` on a CPU with AMX, where repacking segfaults). Every request is a fresh prompt (random
words, a new seed each time, so no cache helps) with max_tokens 1; before each one the benchmark
waits for an idle CPU, and the systems take turns, length by length, round by round.

Per length: each system's first-token time (median of the rounds) and prompt tokens per second,
the ratio llmd / llama-server, and llama-bench's best `pp` rate for that length (over flash
attention on and off, micro-batches of 64 and 512) as the ceiling. After each of llmd's answers:
the CPU seconds its processes used from the answer until they were quiet again, against the CPU
seconds the answer took, and how long a CPU-bound probe (one process per core) started right
after the answer takes against the same probe on an idle machine.

    python benchmarks/prompts.py --model ~/.cache/llmd/test-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        [--lengths 1000,4000,8000,16000,30000] [--rounds 2] [--no-ceiling]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import ROOT, cpu_name, free_port, start_llmd_with, stop, wait_http  # noqa: E402

WORDS = ("lighthouse keeper harbour storm lantern rope tide gull cliff beacon ship fog bell signal wave "
         "stone stair window night morning oil wick glass island coast current anchor sail cargo river "
         "mill bridge market copper iron salt bread orchard valley meadow frost ember cinder hollow").split()


def prompt_of(n_tokens: int, seed: int) -> str:
    """About n_tokens tokens of random words (Qwen's tokenizer: about 1.15 tokens a word here)."""
    rnd = random.Random(seed)
    return f"[{seed}] " + " ".join(rnd.choice(WORDS) for _ in range(int(n_tokens / 1.15)))


def wait_quiet(busy_below: float = 8.0, timeout: float = 120.0) -> float:
    """Wait until the whole machine's CPU is under `busy_below` percent over half a second."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if psutil.cpu_percent(interval=0.5) < busy_below:
            break
    return time.monotonic() - t0


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process and its children so far."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        pass
    return total


def first_token(url: str, model: str, text: str) -> tuple[float, int]:
    """Seconds to the first streamed token of a chat holding `text`, and its prompt tokens."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, n_prompt = float("nan"), 0
    with httpx.Client(timeout=3600) as c, c.stream("POST", url + "/v1/chat/completions", json=body,
                                                   headers={"Cache-Control": "no-store"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft != ttft and any((ch.get("delta") or {}).get("content") for ch in chunk.get("choices", [])):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                n_prompt = chunk["usage"]["prompt_tokens"]
    if ttft != ttft:  # a reply whose only token carried no text: the end of the stream stands for it
        ttft = time.perf_counter() - t0
    return ttft, n_prompt


def _spin(n: int) -> None:
    x = 0
    for i in range(n):
        x ^= i * i
    if x == -1:
        print(x)


def probe(n: int) -> float:
    """Seconds a CPU-bound program with one process per core takes for a fixed amount of work."""
    t0 = time.perf_counter()
    procs = [multiprocessing.Process(target=_spin, args=(n,)) for _ in range(psutil.cpu_count(logical=True) or 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return time.perf_counter() - t0


def llama_server_for(model: str, n_ctx: int) -> tuple[subprocess.Popen, str, list[str], Path]:
    tool = ROOT.parent / "shared" / "tools" / "build-llama-server.sh"
    if not tool.exists():
        tool = ROOT / "scripts" / "build-llama-server.sh"
    bin_dir = Path(subprocess.run(["bash", str(tool)], check=True, capture_output=True, text=True).stdout.strip())
    amx = "amx_tile" in Path("/proc/cpuinfo").read_text()
    args = [str(bin_dir / "llama-server"), "-m", model, "-c", str(n_ctx), "--port", str(port := free_port()),
            "--host", "127.0.0.1", *(["--no-repack"] if amx else [])]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc)
    while httpx.get(url + "/health").status_code != 200:
        time.sleep(0.2)
    return proc, url, args, bin_dir


def ceiling(bin_dir: Path, model: str, length: int) -> tuple[float, str]:
    """llama-bench's best prompt rate for `length` tokens here, and the settings that gave it."""
    amx = "amx_tile" in Path("/proc/cpuinfo").read_text()
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", model, "-p", str(length), "-n", "0", "-r", "1", "--no-warmup",
                          "-fa", "0,1", "-ub", "64,512", "-b", "512", "-o", "json",
                          *(["--repack", "0"] if amx else [])],
                         check=True, capture_output=True, text=True).stdout
    best = max(json.loads(out), key=lambda r: r["avg_ts"])
    return best["avg_ts"], f"fa {int(bool(best['flash_attn']))} ub {best['n_ubatch']}"


def llmd_attention(url: str) -> str:
    loaded = httpx.get(url + "/llmd/status", timeout=30).json()["loaded"]
    return "; ".join(f"{m.get('name')}: {m.get('attention')}" for m in loaded)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache/llmd/test-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"))
    ap.add_argument("--lengths", default="1000,4000,8000,16000,30000")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-ceiling", action="store_true", help="skip llama-bench (its runs take as long as the rest)")
    ap.add_argument("--probe", type=int, default=30_000_000, help="the probe's work per process (loop turns)")
    ap.add_argument("--llmd-env", action="append", default=[], metavar="NAME=VALUE",
                    help="a setting for llmd instead of its default (e.g. LLMD_FLASH_ATTN=on), to compare")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    n_ctx = max(4096, -(-int(max(lengths) * 1.1 + 512) // 1024) * 1024)

    print(f"CPU: {cpu_name()}, {psutil.cpu_count(logical=False)} cores; model {Path(args.model).name}")
    lproc, lurl, _ = start_llmd_with({"coder": args.model}, env=dict(e.split("=", 1) for e in args.llmd_env))
    sproc, surl, sargs, bin_dir = llama_server_for(args.model, n_ctx)
    print(f"llmd: {' '.join(args.llmd_env) or 'defaults'} ({llmd_attention(lurl)}); llama-server: {' '.join(Path(a).name if i == 0 else a for i, a in enumerate(sargs) if not a.isdigit() or i < 3)}")
    results: dict[tuple[str, int], list[tuple[float, int]]] = {}
    idle_rows: list[tuple[int, float, float, float]] = []  # length, answer CPU s, idle CPU s after it, probe s
    wait_quiet()
    alone = statistics.median(probe(args.probe) for _ in range(3))
    seed = random.randrange(1 << 30)
    try:
        for r in range(args.rounds):
            for length in lengths:
                order = [("llmd", lurl, "coder"), ("llama-server", surl, "coder")]
                for name, url, model in order if r % 2 == 0 else order[::-1]:
                    wait_quiet()
                    seed += 1
                    c0 = tree_cpu(lproc.pid)
                    ttft, n = first_token(url, model, prompt_of(length, seed))
                    results.setdefault((name, length), []).append((ttft, n))
                    print(f"  round {r + 1} {name:12s} {n:6d} tokens: {ttft:7.2f} s ({n / ttft:6.1f} tok/s)", flush=True)
                    if name == "llmd":
                        c1 = tree_cpu(lproc.pid)
                        p = probe(args.probe)  # a program started right after the answer
                        wait_quiet()
                        idle_rows.append((length, c1 - c0, tree_cpu(lproc.pid) - c1, p))
    finally:
        stop(sproc)
        status = httpx.get(lurl + "/llmd/status", timeout=30).json()
        stop(lproc)

    ceilings: dict[int, tuple[float, str]] = {}
    if not args.no_ceiling:
        wait_quiet()
        for length in lengths:
            ceilings[length] = ceiling(bin_dir, args.model, length)

    print(f"\nCold prompts, first token (median of {args.rounds} rounds); ceiling: llama-bench's best pp")
    print(f"{'tokens':>7} {'llmd s':>8} {'server s':>9} {'llmd/server':>12} {'llmd tok/s':>11} {'server tok/s':>13}"
          f" {'ceiling tok/s':>14} {'llmd/ceiling':>13}")
    for length in lengths:
        mine, theirs = results[("llmd", length)], results[("llama-server", length)]
        lt, st = statistics.median(t for t, _ in mine), statistics.median(t for t, _ in theirs)
        ln, sn = mine[0][1], theirs[0][1]
        ceil, how = ceilings.get(length, (float("nan"), ""))
        print(f"{ln:7d} {lt:8.2f} {st:9.2f} {lt / st:11.2f}x {ln / lt:11.1f} {sn / st:13.1f} "
              f"{ceil:9.1f} {how:>10s} {ln / lt / ceil:12.2f}")
    print("\nAfter each of llmd's answers: CPU its processes used until quiet, and a probe started right after")
    print(f"{'tokens':>7} {'answer CPU s':>13} {'after CPU s':>12} {'after/answer':>13} {'probe s':>8} {'probe/alone':>12}")
    for length, ans, after, p in idle_rows:
        print(f"{length:7d} {ans:13.1f} {after:12.2f} {after / ans:12.1%} {p:8.2f} {p / alone:11.2f}x")
    loaded = status.get("loaded") or [{}]
    idle = (loaded[0].get("stats") or {}).get("idle")
    print(f"\nprobe alone: {alone:.2f} s; llmd's own count of its idle work: {idle}")


if __name__ == "__main__":
    main()
