"""The memory estimate against what the worker really holds, on a real model.

Starts llmd with a model (and, with --draft, its draft registered beside it, so llmd pairs it),
sends a request that fills a slot's context, then reads the worker's resident memory (psutil)
and compares it with the estimate `/llmd/status` gives (weights + KV cache for every slot +
compute buffers). llama.cpp clears the whole KV buffer when it creates the context, so every
slot's KV is resident from the load on; the weights are resident once a forward pass read them.

    python benchmarks/memory_fit.py --model QWEN_1.5B.gguf [--draft QWEN_0.5B.gguf]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import start_llmd_with, stop  # noqa: E402

MB = 1024 * 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default="")
    ap.add_argument("--ctx", type=int, default=0, help="tokens per slot (default: llmd's automatic choice)")
    ap.add_argument("--slots", type=int, default=0, help="slots (default: llmd's)")
    ap.add_argument("--fill", type=int, default=4096, help="the request's prompt, tokens (at most a slot's context)")
    args = ap.parse_args()
    name = Path(args.model).stem.lower()
    models = {name: args.model, **({Path(args.draft).stem.lower(): args.draft} if args.draft else {})}
    env = {**({"LLMD_CTX": str(args.ctx)} if args.ctx else {}), **({"LLMD_SLOTS": str(args.slots)} if args.slots else {})}
    proc, url, _ = start_llmd_with(models, env)
    try:
        m = next(m for m in httpx.get(url + "/llmd/status", timeout=60).json()["loaded"] if m["name"] == name)
        args.ctx, args.slots = m["n_ctx"], m["n_slots"]
        worker = psutil.Process(m["pid"])
        after_load = worker.memory_info().rss
        # a prompt of about `fill` tokens (trimmed to what a slot holds), then 64 decoded
        fill = min(args.fill, args.ctx)
        words = " ".join(f"w{i % 997}" for i in range(fill))
        body = {"model": name, "messages": [{"role": "user", "content": words}], "max_tokens": 64,
                "temperature": 0}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=1800, headers={"Cache-Control": "no-store"})
        if r.status_code == 400:  # too long: trim to what the error says fits
            n = int(r.json()["error"]["message"].split("prompt is ")[1].split()[0])
            keep = int(fill * args.ctx / n) - 96
            body["messages"][0]["content"] = " ".join(f"w{i % 997}" for i in range(keep))
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=1800,
                           headers={"Cache-Control": "no-store"})
        r.raise_for_status()
        usage = r.json()["usage"]
        after = worker.memory_info().rss
        est = m["memory_estimate"]
        print(f"# memory fit: {name}" + (f" + draft {m.get('draft')}" if m.get("draft") else "")
              + f", {args.slots} slots x {args.ctx} tokens ({m.get('ctx_reason')}); weight repacking: "
              + f"{(m.get('repack') or {}).get('repack')} ({(m.get('repack') or {}).get('reason')})")
        print(f"estimate: weights {est['weights'] / MB:.0f} + KV {est['kv'] / MB:.0f} + compute "
              f"{est['compute'] / MB:.0f} = {est['total'] / MB:.0f} MiB")
        print(f"worker RSS after load {after_load / MB:.0f} MiB; after a {usage['prompt_tokens']}+"
              f"{usage['completion_tokens']}-token request {after / MB:.0f} MiB")
        print(f"estimate / measured: {est['total'] / after:.3f} ({(est['total'] - after) / after:+.1%})")
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
