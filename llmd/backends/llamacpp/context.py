"""Loading a GGUF and creating its llama.cpp context: shared by the engine, the draft model and eval.

Also the one `decode` every llama_decode goes through, so the test-only crash switch
(LLMD_TEST_CRASH, see backends/repack.py) behaves like the real AMX crash: a SIGSEGV at the
first decode of more than one token while weights are repacked.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from typing import Any

from llmd.backends.crash_switch import CRASH_ENV
from llmd.errors import EngineError


def physical_cores() -> int:
    try:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except Exception:
        return os.cpu_count() or 1


def release_mapped(path: str) -> int:
    """Give back the resident pages of the model file's mapping; returns the bytes of mapping advised.

    Repacked weights are copied out of the mapped file into a buffer of their own, and the pages
    they were copied from stay resident beside the copy: measured on AMD with the 1.5B model, the
    whole 1,060 MiB mapping resident beside a 597 MiB repacked buffer (llama-cpp-python 0.3.36's
    llama_model_params has `load_mode` where `use_mmap` was: setting use_mmap did nothing). The
    file's pages are clean page cache, so dropping them from this
    process costs nothing: the tensors still read from the mapping fault back in at the warm-up's
    first pass (from the page cache), the repacked ones are never touched again."""
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    real, advised = os.path.realpath(path), 0
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() == real:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    if libc.madvise(lo, hi - lo, 4) == 0:  # MADV_DONTNEED
                        advised += hi - lo
    except OSError:  # no /proc (not Linux): the pages stay, as before
        return 0
    return advised


_LOG_ERROR, _LOG_CONT = 4, 5  # ggml_log_level in llama.cpp 0.3.36 (NONE 0, DEBUG 1, INFO 2, WARN 3)
# what llama.cpp logs as errors when a decode was aborted on purpose (idle work, a step given up for
# a newcomer: ggml status 1 is GGML_STATUS_ABORTED, llama_decode's 2 the same)
_ABORTED = (b"failed with error 1\n", b"compute status: 1\n", b"failed to decode, ret = 2\n")
_log_state: dict[str, Any] = {"error": False, "callback": None}


def quiet_llama_log() -> None:
    """llama.cpp's errors to stderr, nothing else. llama-cpp-python's own filter maps the levels of an
    older ggml (WARN was 2, ERROR 3): with verbose off it printed every warning (one per load, one per
    decode given up for a newcomer) and dropped the errors."""
    import llama_cpp as L

    if _log_state["callback"] is not None:
        return

    def log(level: int, text: bytes, _data: ctypes.c_void_p) -> None:
        if level != _LOG_CONT:
            _log_state["error"] = level == _LOG_ERROR
        if _log_state["error"] and not any(line in text for line in _ABORTED):
            sys.stderr.write(text.decode("utf-8", "replace"))
            sys.stderr.flush()

    _log_state["callback"] = L.llama_log_callback(log)  # kept: llama.cpp holds only the pointer
    L.llama_log_set(_log_state["callback"], ctypes.c_void_p(0))


def load_model(path: str, gpu_layers: int = 0, repack: bool = True, what: str = "") -> Any:
    """A llama_model pointer; EngineError naming the file when llama.cpp refuses it."""
    import llama_cpp as L

    if os.environ.get(CRASH_ENV) == "hang-load":  # test switch: a load that never returns
        time.sleep(3600)
    L.llama_backend_init()
    quiet_llama_log()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = gpu_layers
    mp.use_extra_bufts = repack  # weight repacking (AMX and others): off where it crashed
    model = L.llama_model_load_from_file(path.encode(), mp)
    if not model:
        raise EngineError(f"llama.cpp could not load {what or 'the model'} {path}; is it a complete GGUF file?")
    if repack and gpu_layers == 0:
        release_mapped(path)
    return model


def flash_attention(setting: str, exact: bool, gpu_layers: int) -> bool:
    """Whether a generation context uses llama.cpp's flash-attention kernel (LLMD_FLASH_ATTN).

    auto: off on the CPU under the fast policy, which then attends by matrix products: on the 1.5B
    on two cores a 15-token step after 3,000 tokens took 0.65x as long and a decoded token there
    0.84x, for 4-11% more under 100 tokens (benchmarks/attention.py), and it brought #38's four
    paths level with or ahead of llama-server (docs/BENCHMARKS.md). on keeps the kernel, as
    llama-server's `-fa auto` on the CPU. The exact policy and GPU layers keep flash attention
    whatever is asked: exact's batch-invariance rules were measured with it, and on a GPU it is
    both faster and smaller."""
    if exact or gpu_layers != 0:
        return True
    return setting == "on"


def new_context(model: Any, n_ctx: int, n_batch: int, n_seq: int, threads: int, unified: bool = True,
                n_ubatch: int | None = None, pooling: int | None = None, flash_attn: bool = True) -> Any:
    """A context, with flash attention unless told otherwise; None when llama.cpp cannot allocate
    it. With `pooling` (a LLAMA_POOLING_TYPE_*; UNSPECIFIED: the model's own) it computes
    embeddings instead of logits."""
    import llama_cpp as L

    cp = L.llama_context_default_params()
    if pooling is not None:
        cp.embeddings = True
        cp.pooling_type = pooling
    cp.n_ctx = n_ctx
    cp.n_batch = n_batch
    cp.n_ubatch = n_ubatch or n_batch
    cp.n_seq_max = n_seq
    cp.kv_unified = unified
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.n_threads = cp.n_threads_batch = threads or physical_cores()
    cp.no_perf = True
    return L.llama_init_from_model(model, cp)


class Decoder:
    """llama_decode with the test crash switch; one per context."""

    def __init__(self, ctx: Any, repack: bool) -> None:
        import llama_cpp as L

        self._decode = L.llama_decode
        self.ctx = ctx
        mode = os.environ.get(CRASH_ENV, "")
        self._crash = mode == "always" or (mode == "repack" and repack)
        self._hang = mode == "hang"  # a kernel that never returns, on prompts longer than warm-up's
        self._raise = mode == "raise"  # a decode that raises (a bug's stand-in), on the same prompts

    def __call__(self, batch: Any) -> int:
        if self._crash and batch.n_tokens > 1:
            os.kill(os.getpid(), signal.SIGSEGV)  # as the AMX kernels do (test switch only)
        if self._hang and batch.n_tokens > 100:
            time.sleep(3600)
        if self._raise and batch.n_tokens > 100:
            raise RuntimeError("test switch: a decode that fails")
        return int(self._decode(self.ctx, batch))


def warm_up(decode: Decoder, batch: Any, mem: Any, n_tokens: int, n_seqs: int, n_vocab: int) -> bool:
    """Throwaway decodes that run every kernel a request will: `n_tokens` of prefill in one batch,
    then one token in each of two sequences in one batch. A kernel that crashes (AMX weight
    repacking does, at the first multi-token decode) then crashes here, while loading, where the
    daemon can fall back, and never at a user's request. Also touches the buffers, so the first
    request pays no first-call costs. False when llama.cpp refuses a decode."""
    import llama_cpp as L

    from llmd.backends.llamacpp.batch import put

    base = 100 if n_vocab > 200 else 0
    tokens = [base + i % max(1, n_vocab - base) for i in range(n_tokens)]
    for i, t in enumerate(tokens):
        put(batch, i, t, i, 0, i == n_tokens - 1)
    batch.n_tokens = n_tokens
    ok = decode(batch) == 0
    if ok and n_seqs > 1:
        put(batch, 0, tokens[0], n_tokens, 0, True)
        put(batch, 1, tokens[0], 0, 1, True)
        batch.n_tokens = 2
        ok = decode(batch) == 0
    L.llama_memory_clear(mem, True)
    return ok


def tokenize(vocab: Any, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
    import llama_cpp as L

    data = text.encode("utf-8")
    cap = len(data) + 8
    buf = (L.llama_token * cap)()
    n = L.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
    if n < 0:
        cap = -n
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
    return list(buf[:n])


def token_piece(vocab: Any, token: int, special: bool = False) -> bytes:
    import llama_cpp as L

    buf = ctypes.create_string_buffer(64)
    n = L.llama_token_to_piece(vocab, token, buf, 64, 0, special)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = L.llama_token_to_piece(vocab, token, buf, -n, 0, special)
    return buf.raw[:n]


def resident_bytes() -> int:
    """This process's resident memory now (what a load adds is the difference)."""
    import psutil

    return int(psutil.Process().memory_info().rss)
