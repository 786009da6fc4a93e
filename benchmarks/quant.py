"""The table to read before choosing a quantization: SmolLM2 in F16, Q8_0, Q4_K_M, Q4_0 and
Q4_1 (as shipped): file size, load time, prefill and decode tokens/s, and KL divergence and
top-1 agreement against F16 on llmd's evaluation text.

    python benchmarks/quant.py [--tokens 1024]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from llmd.backends.base import EngineConfig
from llmd.backends.llamacpp.engine import LlamaCppEngine
from llmd.backends.repack import repack_for
from llmd.models.catalog import find_packaged
from llmd.models.evaluate import evaluate
from llmd.models.quantize import plan, quantize


def speed(path: Path) -> tuple[float, float, float]:
    """(load s, prefill tok/s over 256 tokens, decode tok/s over 64 tokens)."""
    t0 = time.perf_counter()
    e = LlamaCppEngine(EngineConfig(str(path), path.stem, 1024, 1, 256, repack=repack_for([str(path)])))
    load = time.perf_counter() - t0
    slot = e.slots[0]
    toks = e.tokenize("The keeper climbed the stairs and trimmed the wick. " * 40, False)[:256]
    t0 = time.perf_counter()
    e._run(slot, toks, 0, True)
    prefill = 256 / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(64):
        e._run(slot, [toks[i]], 256 + i, True)
    decode = 64 / (time.perf_counter() - t0)
    e.close()
    return load, prefill, decode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmd-quant-"))
    q41 = find_packaged()["smollm2-135m"]
    f16 = quantize(plan(q41, work / "smol-f16.gguf", "F16"))
    paths = {"F16": f16}
    for t in ("Q8_0", "Q4_K_M", "Q4_0"):
        paths[t] = quantize(plan(f16, work / f"smol-{t}.gguf", t))
    paths["Q4_1 (shipped)"] = q41
    print(f"\nSmolLM2-135M, KL and top-1 vs F16 over {args.tokens} tokens of llmd's evaluation text")
    print(f"{'type':15} {'size MB':>8} {'load s':>7} {'prefill t/s':>12} {'decode t/s':>11} {'KL mean':>9} "
          f"{'top-1':>7} {'ppl':>7}")
    for name, path in paths.items():
        load, pre, dec = speed(path)
        ev = evaluate(str(path), str(f16), tokens=args.tokens)
        print(f"{name:15} {path.stat().st_size / 1e6:8.1f} {load:7.2f} {pre:12.1f} {dec:11.1f} "
              f"{ev.kl_mean:9.5f} {ev.top1_agreement:7.1%} {ev.perplexity:7.2f}")
    print("(F16 is the reference: its KL is 0 and agreement 100% by construction)")


if __name__ == "__main__":
    main()
