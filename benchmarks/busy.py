"""A busy desktop: llmd and llama-server decoding while other programs keep cores busy.

Each system alone on the machine, same model, slots and context per slot; llama-server with its
default threads (one per physical core, as users run it and as Ollama, LM Studio and others do),
llmd with its default LLMD_THREADS=auto, and llmd with a fixed full thread count as the idle
baseline. Rows: idle, one core busy (one CPU-bound process started by the benchmark), all cores
busy (one per core). Measured: decode tokens/s of a 200-token reply and time to first token of a
~500-token prompt, each prompt new (no cache helps). A reply that crawls is cut after --cap
seconds and its rate taken over what arrived.

    python benchmarks/busy.py [--model PATH] [--rounds 2] [--cap 40]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import ROOT, cpu_name, free_port, med, start_llmd, start_llmd_with, stop, wait_http, wait_idle  # noqa: E402

BUSY = "while True: pass"
NO_STORE = {"Cache-Control": "no-store"}


@contextmanager
def busy(n: int):
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]
    time.sleep(1.0 if n else 0)  # let the scheduler see them
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def stream(url: str, model: str, prompt: str, max_tokens: int, cap: float) -> tuple[float, float]:
    """(TTFT s, decode tok/s) as the client sees it; the stream is cut after `cap` seconds."""
    arrivals: list[float] = []
    t0 = time.perf_counter()
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "cache_prompt": True}
    with httpx.Client(timeout=cap + 600) as c, c.stream("POST", url + "/v1/chat/completions", json=body,
                                                        headers=NO_STORE) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for ch in json.loads(line[6:]).get("choices", []):
                if (ch.get("delta") or {}).get("content"):
                    arrivals.append(time.perf_counter())
            if time.perf_counter() - t0 > cap:
                break
    ttft = arrivals[0] - t0 if arrivals else float("nan")
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0
    return ttft, (len(arrivals) - 1) / span if span > 0 else float("nan")


WORDS = ("harbour storm lantern rope tide gull cliff beacon ship fog bell signal wave stone stair window night "
         "morning oil wick glass island coast current anchor sail cargo").split()


def long_prompt(tag: int) -> str:
    """About 500 tokens, new each time (its first words differ), so no cached prefix helps."""
    rnd = random.Random(tag)
    return (f"Request {tag}: " + " ".join(rnd.choice(WORDS) for _ in range(480))
            + "\nWhich word comes up most often? One word.")


def measure(url: str, model: str, rounds: int, cap: float, tag: int) -> tuple[float, float]:
    decode, ttft = [], []
    for r in range(rounds):
        story = f"({tag}-{r}) Write a long story about a lighthouse keeper and a storm."
        decode.append(stream(url, model, story, 200, cap)[1])
        ttft.append(stream(url, model, long_prompt(tag * 100 + r), 4, cap)[0])
    return med(decode), med(ttft)


def llama_server(model: str, slots: int, ctx: int) -> tuple[subprocess.Popen, str]:
    tool = ROOT.parent / "shared" / "tools" / "build-llama-server.sh"
    if not tool.exists():
        tool = ROOT / "scripts" / "build-llama-server.sh"
    bin_dir = Path(subprocess.run(["bash", str(tool)], capture_output=True, text=True, check=True).stdout.strip())
    port = free_port()
    args = [str(bin_dir / "llama-server"), "-m", model, "-np", str(slots), "-c", str(slots * ctx),
            "--port", str(port), "--host", "127.0.0.1"]
    if "amx" in Path("/proc/cpuinfo").read_text():
        args.append("--no-repack")  # its weight repacking segfaults on AMX
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc)
    return proc, url


def llmd(model_path: str, name: str, threads: str, slots: int, ctx: int) -> tuple[subprocess.Popen, str]:
    """llmd on the packaged default model, or on `model_path` registered as `name`."""
    env = {"LLMD_THREADS": threads, "LLMD_SLOTS": str(slots), "LLMD_CTX": str(ctx)}
    proc, url, _ = start_llmd_with({name: model_path}, env) if model_path else start_llmd(env)
    return proc, url


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="", help="a GGUF (default: the packaged SmolLM2-135M)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cap", type=float, default=40.0, help="seconds after which a crawling reply is cut")
    args = ap.parse_args()
    from llmd.models.catalog import find_packaged

    name = Path(args.model).stem.lower() if args.model else "smollm2-135m"
    path = args.model or str(find_packaged()["smollm2-135m"])
    slots, ctx = 4, 4096
    cores = os.cpu_count() or 1
    conditions = [("idle", 0), ("one core busy", 1), (f"all cores busy ({cores})", cores)]
    systems = {"llama-server": lambda: llama_server(path, slots, ctx),
               "llmd fixed": lambda: llmd(args.model, name, str(cores), slots, ctx),
               "llmd auto": lambda: llmd(args.model, name, "auto", slots, ctx)}
    results: dict[tuple[str, str], tuple[float, float]] = {}
    for sys_name, start in systems.items():
        proc, url = start()
        try:
            model = name if sys_name != "llama-server" else "x"
            stream(url, model, "Hi", 4, 60)  # warm
            for i, (cond, n) in enumerate(conditions):
                if sys_name == "llmd fixed" and n:
                    continue  # only the idle baseline
                if sys_name != "llama-server":
                    wait_idle(url)
                with busy(n):
                    results[(sys_name, cond)] = measure(url, model, args.rounds, args.cap, i * 10 + len(results))
                print(f"  {sys_name:13} {cond:22} decode {results[(sys_name, cond)][0]:7.2f} tok/s  "
                      f"TTFT {results[(sys_name, cond)][1]:7.2f} s", file=sys.stderr)
        finally:
            stop(proc)
    cpu = cpu_name()
    print(f"# busy machine: {name}, {cpu}, {cores} CPUs, slots {slots} x ctx {ctx}, medians of {args.rounds}; "
          f"replies cut after {args.cap:.0f} s")
    print(f"{'condition':<24} {'server tok/s':>12} {'llmd tok/s':>10} {'llmd/server':>11} {'of idle':>8} "
          f"{'server TTFT':>11} {'llmd TTFT':>9} {'llmd/server':>11}")
    idle = results[("llmd auto", "idle")][0]
    for cond, _ in conditions:
        s, a = results[("llama-server", cond)], results[("llmd auto", cond)]
        print(f"{cond:<24} {s[0]:12.2f} {a[0]:10.2f} {a[0] / s[0]:10.2f}x {a[0] / idle:7.0%} "
              f"{s[1]:10.2f}s {a[1]:8.2f}s {a[1] / s[1]:10.2f}x")
    fixed = results[("llmd fixed", "idle")]
    print(f"idle: llmd auto / llmd fixed at {cores} threads: decode {idle / fixed[0]:.3f}x, "
          f"TTFT {results[('llmd auto', 'idle')][1] / fixed[1]:.3f}x")


if __name__ == "__main__":
    main()
