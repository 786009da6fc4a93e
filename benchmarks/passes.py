"""What one engine step costs by which slots it holds, in llmd's layout (one KV stream per slot).

llama.cpp cuts a batch over several KV streams into passes over the weights that each take the
same number of tokens from each sequence, and only sequences whose ids follow each other
(llama-kv-cache.cpp `init_batch`, `split_equal`): decoding slots 0 and 2 is two passes, four
prompts of 7, 8, 11 and 12 new tokens four. Filling the gaps with throwaway tokens (removed after
the step) would make each one pass; this measures whether that could pay on this CPU, by timing
the steps as they are and as they would be padded. Each row is the median of 15 steps, printed
with its ratio to one token in one slot (measured in the same run).

    python benchmarks/passes.py [--model PATH] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from _harness import cpu_name

from llmd.backends.llamacpp.batch import put
from llmd.backends.llamacpp.context import Decoder, load_model, new_context, physical_cores
from llmd.backends.repack import repack_for

QWEN = Path.home() / ".cache/llmd/test-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
CONTEXT = 64  # tokens each slot holds before the timed steps
STEPS = 15

# (what, tokens per slot, slots whose tokens are throwaway padding)
CASES: list[tuple[str, dict[int, int], tuple[int, ...]]] = [
    ("one token in slot 0", {0: 1}, ()),
    ("decode: slots 0 and 1 (one pass)", {0: 1, 1: 1}, ()),
    ("decode: slots 0 and 2 (two passes)", {0: 1, 2: 1}, ()),
    ("decode: slots 0 and 2, slot 1 padded (one pass)", {0: 1, 1: 1, 2: 1}, (1,)),
    ("decode: slots 0-3 (one pass)", {0: 1, 1: 1, 2: 1, 3: 1}, ()),
    ("4 drafts in slot 0 beside 1 token in slot 1 (two passes)", {0: 4, 1: 1}, ()),
    ("the same, slot 1 padded to 4 (one pass)", {0: 4, 1: 4}, ()),
    ("4 tokens in slot 0 alone", {0: 4}, ()),
    ("prefill 7, 8, 11, 12 tokens in slots 0-3 (four passes)", {0: 7, 1: 8, 2: 11, 3: 12}, ()),
    ("the same padded to 12 each (one pass)", {0: 12, 1: 12, 2: 12, 3: 12}, ()),
    ("prefill 7 tokens in each of slots 0-3", {0: 7, 1: 7, 2: 7, 3: 7}, ()),
    *[(f"{k} tokens in slot 0 alone", {0: k}, ()) for k in (2, 8, 16, 32)],
]


def main() -> None:
    import llama_cpp as L

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(QWEN))
    ap.add_argument("--threads", type=int, default=physical_cores())
    args = ap.parse_args()
    repack = repack_for([args.model])  # llmd's own choice: repacking crashes on AMX CPUs
    model = load_model(args.model, 0, repack)
    ctx = new_context(model, 4096 * 4, 512, 4, args.threads, unified=False)
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(512, 0, 1)
    decode = Decoder(ctx, repack)
    pos = [0, 0, 0, 0]

    def step(counts: dict[int, int], pad: tuple[int, ...]) -> float:
        i = 0
        for seq, n in sorted(counts.items()):  # in slot order, as the engine writes its batch
            for j in range(n):
                put(batch, i, 100 + j, pos[seq] + j, seq, j == n - 1 and seq not in pad)
                i += 1
        batch.n_tokens = i
        t0 = time.perf_counter()
        if decode(batch) != 0:
            raise SystemExit("llama_decode failed")
        took = time.perf_counter() - t0
        for seq, n in counts.items():
            if seq in pad:  # throwaway tokens: their KV goes again
                L.llama_memory_seq_rm(mem, seq, pos[seq], -1)
            else:
                pos[seq] += n
        return took

    for seq in range(4):
        step({seq: CONTEXT}, ())
    base = 0.0
    print(f"# one step's cost by the slots it holds: {Path(args.model).name}, {cpu_name()}, "
          f"{args.threads} threads, weight repacking {'on' if repack else 'off'}, 4 KV streams, {CONTEXT} tokens in each; median of {STEPS} steps")
    print(f"{'step':<60}{'ms':>9}{'x one token':>13}")
    for what, counts, pad in CASES:
        took = statistics.median(step(counts, pad) for _ in range(STEPS))
        base = base or took
        print(f"{what:<60}{took * 1000:>9.1f}{took / base:>13.2f}", flush=True)
        for seq in range(4):  # every case starts from the same context
            L.llama_memory_seq_rm(mem, seq, CONTEXT, -1)
            pos[seq] = CONTEXT


if __name__ == "__main__":
    main()
