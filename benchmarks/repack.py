"""Weight repacking on and off on this CPU: prefill and decode tokens/s of the default model, so
LLMD_REPACK's default is a measured choice. Runs alternate (on, off, on, off...) so the machine's
slow spells hit both alike; medians are printed with the ratio off/on. Where repacking crashes
(a trial load in a child process finds out first) only "off" is measured.

    python benchmarks/repack.py [--runs 5] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import statistics
import time

from llmd.backends.llamacpp.batch import put
from llmd.backends.llamacpp.context import Decoder, load_model, new_context, physical_cores
from llmd.backends.llamacpp.trial import crash_signal
from llmd.backends.repack import llama_cpp_version, repack_kind
from llmd.backends.select import cpu_identity
from llmd.config import load_settings
from llmd.models.registry import Registry

PREFILL = 512
DECODE = 128


def measure(path: str, repack: bool) -> tuple[float, float]:
    """(prefill tok/s over PREFILL tokens in one batch, decode tok/s over DECODE single-token steps)."""
    import llama_cpp as L

    model = load_model(path, 0, repack)
    ctx = new_context(model, 2048, PREFILL, 1, 0)
    decode = Decoder(ctx, repack)
    batch = L.llama_batch_init(PREFILL, 0, 1)
    mem = L.llama_get_memory(ctx)
    toks = [100 + i % 1000 for i in range(PREFILL)]

    def prefill() -> float:
        L.llama_memory_clear(mem, True)
        for i, t in enumerate(toks):
            put(batch, i, t, i, 0, i == PREFILL - 1)
        batch.n_tokens = PREFILL
        t0 = time.perf_counter()
        assert decode(batch) == 0
        return time.perf_counter() - t0

    prefill()  # warm-up
    pp = PREFILL / prefill()
    t0 = time.perf_counter()
    for i in range(DECODE):
        put(batch, 0, toks[i], PREFILL + i, 0, True)
        batch.n_tokens = 1
        assert decode(batch) == 0
    tg = DECODE / (time.perf_counter() - t0)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return pp, tg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    settings = load_settings()
    settings.paths.ensure()
    registry = Registry(settings.paths.registry_db, settings.paths.models_dir)
    registry.sync_packaged()
    row = registry.get(args.model)
    cpu, flags = cpu_identity()
    print(f"{args.model} ({row['quantization']}), {cpu}, {physical_cores()} threads, llama-cpp-python "
          f"{llama_cpp_version()}, repacking for {repack_kind(flags)}")
    sig = crash_signal([row["path"]])
    modes = [False] if sig else [True, False]
    if sig:
        print(f"repacking on: crashes on this CPU (killed by signal {sig}); measuring off only")
    results: dict[bool, list[tuple[float, float]]] = {m: [] for m in modes}
    for _ in range(args.runs):
        for m in modes:
            results[m].append(measure(row["path"], m))
    med = {m: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)) for m, rs in results.items()}
    print(f"{'repack':<8} {'prefill tok/s (pp' + str(PREFILL) + ')':>24} {'decode tok/s (tg' + str(DECODE) + ')':>24}")
    for m in modes:
        print(f"{'on' if m else 'off':<8} {med[m][0]:>24.1f} {med[m][1]:>24.1f}")
    if len(modes) == 2:
        print(f"{'off/on':<8} {med[False][0] / med[True][0]:>24.2f} {med[False][1] / med[True][1]:>24.2f}")


if __name__ == "__main__":
    main()
