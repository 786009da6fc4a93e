"""What llama.cpp's two attention kernels cost a step on this CPU: flash attention (llama-server's
choice, its `-fa auto`) against matrix products (llmd's fast policy on the CPU, LLMD_FLASH_ATTN).

One model, two contexts of a KV stream per history, the same steps taking turns: k new tokens after h
tokens of history in a slot (k = 1 is a decoded token; 4 a verification of drafts; 15 a chat's new
message after its cached conversation), medians of several rounds. The ratio is measured in the
same run, so this machine's slow spells hit both alike.

With --prefill, cold prompts instead (issue 51): each length read from an empty 32,768-token slot
in 512-token steps, by flash attention, by matrix products in llmd's old fixed micro-batches (the
largest whose scores against a whole slot fit ATTN_SCRATCH), in micro-batches of 512, and in
micro-batches cut by depth (what the engine does now: the largest whose scores against the cells
filled so far fit ATTN_SCRATCH), in prompt tokens per second.

    python benchmarks/attention.py [--model PATH.gguf] [--rounds 7]
    python benchmarks/attention.py --prefill [--lengths 1024,4096,8192] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import ROOT, cpu_name  # noqa: E402

sys.path.insert(0, str(ROOT))
from llmd.backends.llamacpp.batch import put  # noqa: E402
from llmd.backends.llamacpp.context import Decoder, load_model, new_context  # noqa: E402
from llmd.backends.repack import repack_for  # noqa: E402
from llmd.models.memory import attention_rows, attention_ubatch  # noqa: E402

PER_SLOT = 8192
HISTORIES = (30, 300, 1000, 3000, 7000)
NEW = (1, 4, 15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache/llmd/test-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", action="store_true", help="cold prompts by kernel and micro-batch")
    ap.add_argument("--lengths", default="1024,4096,8192")
    args = ap.parse_args()
    if args.prefill:
        return prefill(args)
    import llama_cpp as L

    repack = repack_for([args.model])
    model = load_model(args.model, 0, repack)
    ub = attention_ubatch(PER_SLOT, L.llama_model_n_head(model))
    kinds = {"flash": (True, 512), "matmul": (False, ub)}
    ctxs = {}
    for name, (fa, n_ubatch) in kinds.items():
        ctx = new_context(model, PER_SLOT * len(HISTORIES), 512, len(HISTORIES), args.threads, unified=False,
                          n_ubatch=n_ubatch, flash_attn=fa)
        ctxs[name] = (L.llama_get_memory(ctx), Decoder(ctx, repack))
    batch = L.llama_batch_init(512, 0, 1)

    def step(name: str, seq: int, start: int, n: int) -> float:
        for j in range(n):
            put(batch, j, 100 + (j * 37 + start) % 5000, start + j, seq, j == n - 1)
        batch.n_tokens = n
        t0 = time.perf_counter()
        if ctxs[name][1](batch) != 0:
            raise SystemExit(f"llama_decode failed ({name}, {n} tokens at {start})")
        return time.perf_counter() - t0

    histories = [h for h in HISTORIES if h + max(NEW) <= PER_SLOT]
    slots = {h: i for i, h in enumerate(histories)}
    for name in ctxs:  # each history in its own slot
        for h in histories:
            for s in range(0, h, 256):
                step(name, slots[h], s, min(256, h - s))
    got: dict[tuple[int, int, str], list[float]] = {}
    for _ in range(args.rounds):
        for h in histories:
            for k in NEW:
                for name in ctxs:
                    got.setdefault((h, k, name), []).append(step(name, slots[h], h, k))
                    L.llama_memory_seq_rm(ctxs[name][0], slots[h], h, -1)
    print(f"# attention kernels: {Path(args.model).name}, {cpu_name()}, {args.threads} threads, {len(histories)} KV streams of "
          f"{PER_SLOT} tokens; matmul in micro-batches of {ub}; medians of {args.rounds} rounds, taking turns")
    print(f"{'step':<28}{'flash ms':>10}{'matmul ms':>11}{'matmul/flash':>14}")
    for h in histories:
        for k in NEW:
            a, b = (statistics.median(got[(h, k, n)]) * 1000 for n in ("flash", "matmul"))
            print(f"{f'{k} tokens after {h}':<28}{a:>10.1f}{b:>11.1f}{b / a:>14.3f}")


def prefill(args: argparse.Namespace) -> None:
    import llama_cpp as L

    repack = repack_for([args.model])
    model = load_model(args.model, 0, repack)
    n_head = L.llama_model_n_head(model)
    slot = 32768
    fixed = attention_ubatch(slot, n_head)
    kinds = {"flash 512": (True, 512, False), f"matmul {fixed}": (False, fixed, False),
             "matmul 512": (False, 512, False), "matmul by depth": (False, 512, True)}
    batch = L.llama_batch_init(512, 0, 1)
    lengths = [int(x) for x in args.lengths.split(",")]
    got: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        for name, (fa, ub, by_depth) in kinds.items():  # one context at a time: each holds a 32k slot
            ctx = new_context(model, slot, 512, 1, args.threads, unified=False, n_ubatch=ub, flash_attn=fa)
            mem, decode = L.llama_get_memory(ctx), Decoder(ctx, repack)
            for n in lengths:
                L.llama_memory_seq_rm(mem, 0, 0, -1)
                t0, pos = time.perf_counter(), 0
                while pos < n:
                    step = min(512, n - pos, attention_rows(pos + 512, n_head) if by_depth else 512)
                    for j in range(step):
                        put(batch, j, 100 + (j * 37 + pos) % 5000, pos + j, 0, pos + j == n - 1)
                    batch.n_tokens = step
                    if decode(batch) != 0:
                        raise SystemExit(f"llama_decode failed ({name}, {step} tokens at {pos})")
                    pos += step
                got.setdefault((n, name), []).append(n / (time.perf_counter() - t0))
            L.llama_free(ctx)
    print(f"# cold prefill: {Path(args.model).name}, {cpu_name()}, {args.threads} threads, one 32,768-token slot; "
          f"prompt tokens/s, medians of {args.rounds} rounds")
    print(f"{'tokens':>7}" + "".join(f"{k:>17}" for k in kinds))
    for n in lengths:
        print(f"{n:>7}" + "".join(f"{statistics.median(got[(n, k)]):>17.1f}" for k in kinds))


if __name__ == "__main__":
    main()
