"""A trial load in a child process: does this GGUF survive loading and warm-up with repacking on?

The daemon learns it from its worker; commands that run a model in their own process (`llmd
eval`) ask here first, so a crashing kernel kills the child and not the command.
Run as `python -m llmd.backends.llamacpp.trial PATH [PATH...]`.
"""

from __future__ import annotations

import subprocess
import sys


def crash_signal(paths: list[str], timeout: float = 300.0) -> int:
    """The signal that killed a trial load of `paths` with repacking on; 0 when it survived."""
    proc = subprocess.run([sys.executable, "-m", __name__, *paths], capture_output=True, timeout=timeout)
    return -proc.returncode if proc.returncode < 0 else 0


def main(paths: list[str]) -> int:
    import llama_cpp as L

    from llmd.backends.llamacpp.context import Decoder, load_model, new_context, warm_up

    for path in paths:
        model = load_model(path, 0, True)
        ctx = new_context(model, 512, 128, 2, 0)
        batch = L.llama_batch_init(128, 0, 1)
        ok = warm_up(Decoder(ctx, True), batch, L.llama_get_memory(ctx), 64, 2,
                     L.llama_vocab_n_tokens(L.llama_model_get_vocab(model)))
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
        if not ok:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
