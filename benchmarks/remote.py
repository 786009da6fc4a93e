"""What llmd costs in front of a remote engine: the same streamed requests sent to llama.cpp's
llama-server directly and through llmd (a remote model whose upstream is that server), taking
turns, then the response cache's gain on a repeat. Then llmd's own cost with the model's time
taken out: the same against a stand-in upstream in its own process that answers at once
(tests/upstream_server.py), where llama-server's run-to-run spread (tens of ms) cannot hide it:
the TTFT llmd adds, and how many tokens a second it can relay (its CPU per token).

Every request has a new first line, so neither path reuses a cached prompt prefix; llmd's
response cache is bypassed (Cache-Control: no-store) except in the repeat test. llama-server is
built by scripts/build-llama-server.sh (cached); on a CPU with AMX it runs with --no-repack.

    python benchmarks/remote.py [--runs 8] [--tokens 64] [--threads 2] [--instant-only] [--vllm URL]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import ROOT, free_port, med, start_llmd, stop, stream_openai_chat, wait_http  # noqa: E402

from llmd.models.catalog import find_packaged  # noqa: E402

QUESTION = "Write a detailed story about a lighthouse keeper and a storm."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", default="2", help="llama-server threads")
    ap.add_argument("--instant-only", action="store_true", help="only the stand-in upstream part")
    ap.add_argument("--vllm", metavar="URL", help="also an already running vLLM (benchmarks/vllm_cpu.sh starts one)")
    args = ap.parse_args()
    llmd, url, home = start_llmd()
    env = {**os.environ, "LLMD_HOME": str(home), "LLMD_PORT": url.rsplit(":", 1)[1]}
    server = None
    try:
        if not args.instant_only:
            bin_dir = subprocess.run(["bash", str(ROOT / "scripts" / "build-llama-server.sh")], capture_output=True,
                                     text=True, check=True).stdout.strip()
            port = free_port()
            amx = "amx" in open("/proc/cpuinfo").read()
            server = subprocess.Popen([f"{bin_dir}/llama-server", "-m", str(find_packaged()["smollm2-135m"]),
                                       "--port", str(port), "-np", "2", "-c", "8192", "-t", args.threads, "-a", "smol",
                                       *(["--no-repack"] if amx else [])],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            upstream = f"http://127.0.0.1:{port}"
            wait_http(upstream + "/health", server)
            compare("llama-server", upstream, "smol", url, env, args.runs, args.tokens, "SmolLM2-135M Q4_1")
            server.terminate()
            server.wait(10)
            server = None
        if args.vllm:
            model = httpx.get(args.vllm.rstrip("/") + "/v1/models", timeout=10).json()["data"][0]["id"]
            compare("vllm", args.vllm.rstrip("/"), model, url, env, args.runs, args.tokens, f"{model} (vLLM CPU)")
        instant(url, env, args.runs)
    finally:
        stop(llmd)
        if server is not None:
            server.terminate()
            server.wait(10)


def compare(kind: str, upstream: str, model: str, url: str, env: dict[str, str], runs: int, tokens: int,
            what: str) -> None:
    """The same streamed chats to `upstream` directly and through llmd, taking turns; then a repeat."""
    name = f"via-{kind}"
    subprocess.run([sys.executable, "-m", "llmd", "models", "add", "--remote", upstream, "--name", name,
                    "--upstream-model", model], env=env, check=True, capture_output=True)
    direct_c, llmd_c = httpx.Client(timeout=600), httpx.Client(timeout=600, headers={"Cache-Control": "no-store"})
    results: dict[str, list] = {"direct": [], "llmd": []}
    for i in range(runs + 1):  # the first round warms both paths and is not counted
        for label, base, c, m in (("direct", upstream, direct_c, model), ("llmd", url, llmd_c, name)):
            body = {"model": m, "max_tokens": tokens, "temperature": 0,
                    "messages": [{"role": "system", "content": f"Session {i}-{label}."},
                                 {"role": "user", "content": QUESTION}]}
            s = stream_openai_chat(base, body, c)
            if i:
                results[label].append(s)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"# llmd in front of {kind}: {what}, {cpu}, {os.cpu_count()} CPUs, {runs} runs x {tokens} tokens, medians")
    peer, ours = results["direct"], results["llmd"]
    ttft_p, ttft_o = med([s.ttft_s for s in peer]), med([s.ttft_s for s in ours])
    tps_p, tps_o = med([s.decode_tps for s in peer]), med([s.decode_tps for s in ours])
    print(f"{'':<24} {kind:>12} {'via llmd':>9} {'via llmd / direct':>18}")
    print(f"{'TTFT ms':<24} {ttft_p * 1000:>12.1f} {ttft_o * 1000:>9.1f} {ttft_o / ttft_p:>18.3f}"
          f"   ({(ttft_o - ttft_p) * 1000:+.1f} ms)")
    print(f"{'decode tok/s':<24} {tps_p:>12.1f} {tps_o:>9.1f} {tps_o / tps_p:>18.3f}")
    body = {"model": name, "max_tokens": tokens, "temperature": 0,
            "messages": [{"role": "user", "content": QUESTION + " (repeat)"}]}
    totals = []
    for _ in range(2):
        t0 = time.perf_counter()
        r = direct_c.post(url + "/v1/chat/completions", json=body)  # a client made before: no TLS setup timed
        totals.append((time.perf_counter() - t0, r.headers.get("X-LLMD-Cache")))
    (miss, m_state), (hit, h_state) = totals
    print(f"{'repeat (response cache)':<24} {miss * 1000:>12.1f} {hit * 1000:>9.1f} {hit / miss:>18.3f}"
          f"   (first {m_state}, then {h_state}; total ms)")


def instant(url: str, env: dict[str, str], runs: int) -> None:
    port = free_port()
    fake = subprocess.Popen([sys.executable, str(ROOT / "tests" / "upstream_server.py"), "--port", str(port),
                             "--words", "4000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    upstream = f"http://127.0.0.1:{port}"
    try:
        wait_http(upstream + "/v1/models", fake)
        subprocess.run([sys.executable, "-m", "llmd", "models", "add", "--remote", upstream, "--name", "instant"],
                       env=env, check=True, capture_output=True)
        c = httpx.Client(timeout=600, headers={"Cache-Control": "no-store"})
        rounds = max(40, runs * 5)
        ttft: dict[str, list[float]] = {"direct": [], "llmd": []}
        rate: dict[str, list[float]] = {"direct": [], "llmd": []}
        for i in range(rounds + 1):
            for label, base, model in (("direct", upstream, "fake-model"), ("llmd", url, "instant")):
                body = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": f"hi {i}"}]}
                s = stream_openai_chat(base, body, c)
                if i:
                    ttft[label].append(s.ttft_s)
                if i and i % 8 == 0:  # a long reply now and then: the relay's tokens per second
                    t0 = time.perf_counter()
                    n = len(stream_openai_chat(base, {**body, "max_tokens": 4000}, c).text.split(" "))
                    rate[label].append(n / (time.perf_counter() - t0))
        d, o = med(ttft["direct"]), med(ttft["llmd"])
        rd, ro = med(rate["direct"]), med(rate["llmd"])
        print(f"# against an upstream that answers at once (its own process), {rounds} rounds, medians")
        print(f"{'':<24} {'direct':>12} {'via llmd':>9} {'via llmd / direct':>18}")
        print(f"{'TTFT ms':<24} {d * 1000:>12.2f} {o * 1000:>9.2f} {o / d:>18.3f}   ({(o - d) * 1000:+.2f} ms)")
        print(f"{'relayed tok/s':<24} {rd:>12.0f} {ro:>9.0f} {ro / rd:>18.3f}"
              f"   (llmd adds {(1 / ro - 1 / rd) * 1e6:.0f} us a token)")
    finally:
        fake.terminate()
        fake.wait(10)


if __name__ == "__main__":
    main()
