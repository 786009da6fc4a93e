"""Memory a load needs (weights + KV cache + compute buffers) and the fit check.

Weights are the GGUF's tensor bytes. The KV cache is context x slots x per-token bytes from
n_layer, n_head_kv and head sizes (f16 K and V). Compute buffers were fitted on the worker's
measured RSS growth with SmolLM2-135M (49k vocab: ~22 MB) and Gemma 3 270M (262k vocab: ~65 MB)
at n_ubatch 512: about 12 MB plus 200 bytes per vocabulary entry. Without flash attention the
attention scores of a whole micro-batch against a whole slot are held at once (f32, every head):
that scratch grows with the context, so the micro-batch is made small enough to bound it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import psutil

from llmd.errors import LlmdError
from llmd.models.gguf import GGUFInfo

MB = 1024 * 1024


class DoesNotFit(LlmdError):
    status = 507
    code = "insufficient_memory"
    type = "server_error"


@dataclass(frozen=True)
class Estimate:
    weights: int
    kv: int
    compute: int
    n_ctx: int
    n_slots: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


# Without flash attention llama.cpp holds one micro-batch's attention scores against the KV cells a
# stream has filled (n_kv x rows x n_head, f32): a micro-batch is cut so they stay under this.
# llama-server reserves 848 MiB of compute for a 1.5B model at 32,768 tokens a slot and n_ubatch
# 512 that way. The engine reserves the same (address space, not memory: pages are only touched by
# the scores a step computes) and cuts each step's rows by the depth it reaches (attention_rows), so
# a cold prompt is read in micro-batches of 512 while it is short and of fewer as it grows.
ATTN_SCRATCH = 128 * MB
MAX_UBATCH = 512
MIN_UBATCH = 32
# llama.cpp attends over the filled cells padded up to this many
KV_PAD = 256


def attention_rows(n_kv: int, n_head: int) -> int:
    """The largest power-of-two micro-batch (MIN_UBATCH..MAX_UBATCH) whose attention scores
    against `n_kv` filled cells (padded as llama.cpp does) of every head fit ATTN_SCRATCH."""
    n_kv = -(-max(1, n_kv) // KV_PAD) * KV_PAD
    ub = MAX_UBATCH
    while ub > MIN_UBATCH and n_kv * ub * max(1, n_head) * 4 > ATTN_SCRATCH:
        ub //= 2
    return ub


def attention_ubatch(n_ctx: int, n_head: int) -> int:
    """The micro-batch whose scores against a whole slot of `n_ctx` tokens fit ATTN_SCRATCH."""
    return attention_rows(n_ctx, n_head)


def attention_scratch(n_ctx: int, n_head: int) -> int:
    """Bytes of attention scores a context without flash attention holds at most."""
    return n_ctx * attention_ubatch(n_ctx, n_head) * max(1, n_head) * 4


def estimate(info: GGUFInfo, n_ctx: int, n_slots: int, flash_attn: bool = True) -> Estimate:
    weights = info.file_size - info.data_offset
    kv = n_ctx * n_slots * info.kv_bytes_per_token()
    vocab = info.metadata.get("tokenizer.ggml.tokens")
    n_vocab = vocab if isinstance(vocab, int) else 32000
    compute = 12 * 1000 * 1000 + 200 * n_vocab + (0 if flash_attn else attention_scratch(n_ctx, info.n_head))
    return Estimate(weights, kv, compute, n_ctx, n_slots)


# An automatic context (LLMD_CTX=auto) gives the KV cache at most this share of the memory available
# at load: the model's whole trained context where that fits (a 32k model serves an 8k front-end
# prompt out of the box), less on a machine that has less, and never under AUTO_MIN_CTX tokens.
KV_SHARE = 0.25
AUTO_MIN_CTX = 4096
AUTO_STEP = 1024


@dataclass(frozen=True)
class ContextChoice:
    n_ctx: int  # tokens per slot
    reason: str
    ceiling: int = 0  # what the context may grow to when a prompt needs it (0: it does not grow)


def load_ctx(info: GGUFInfo, n_slots: int, fixed: int, start: int, available: int | None = None,
             draft: GGUFInfo | None = None) -> ContextChoice:
    """The context a load starts with: LLMD_CTX when set, else the automatic choice sized by use."""
    ctx = choose_ctx(info, n_slots, fixed, available, draft)
    return ctx if fixed else starting_ctx(ctx, start)


def starting_ctx(choice: ContextChoice, start: int) -> ContextChoice:
    """An automatic context sized by use (issue 48): a model starts with `start` tokens per slot and
    is loaded again with more, up to the automatic choice, when a prompt needs it. Every slot's KV
    cache is allocated and written at load, so four 32k slots of the 1.5B held 3.5 GiB before any
    prompt was long, and an editor's, a chat's and an agent's models held 9.5 GB together."""
    if not start or choice.n_ctx <= start:
        return choice
    return ContextChoice(start, f"{start} tokens per slot to start (LLMD_CTX_START); grows up to {choice.n_ctx} "
                                f"when a prompt needs it ({choice.reason})", ceiling=choice.n_ctx)


def choose_ctx(info: GGUFInfo, n_slots: int, fixed: int = 0, available: int | None = None,
               draft: GGUFInfo | None = None) -> ContextChoice:
    """The context each slot holds: `fixed` (LLMD_CTX) when set, else the model's trained context,
    bounded by KV_SHARE of the available memory (every slot's KV cache is allocated at load)."""
    train = info.context_length
    if fixed:
        note = f" (the model was trained for {train})" if train and fixed > train else ""
        return ContextChoice(fixed, f"{fixed} tokens per slot: set by LLMD_CTX{note}")
    if not train:
        return ContextChoice(AUTO_MIN_CTX, f"{AUTO_MIN_CTX} tokens per slot: the GGUF does not say its trained "
                                           "context (set LLMD_CTX for more)")
    per_ctx_token = n_slots * (info.kv_bytes_per_token() + (draft.kv_bytes_per_token() if draft else 0))
    avail = available_bytes() if available is None else available
    budget = int(avail * KV_SHARE)
    fits = budget // per_ctx_token // AUTO_STEP * AUTO_STEP if per_ctx_token else train
    kv_train = train * per_ctx_token
    if fits >= train:
        return ContextChoice(train, f"{train} tokens per slot: the model's trained context "
                                    f"({n_slots} slots, KV cache {kv_train // MB} MiB)")
    n_ctx = min(train, max(AUTO_MIN_CTX, fits))
    return ContextChoice(n_ctx, f"{n_ctx} tokens per slot: the model was trained for {train}, but {n_slots} slots "
                                f"of that would need {kv_train // MB} MiB of KV cache and a quarter of the "
                                f"{avail // MB} MiB available is {budget // MB} MiB (set LLMD_CTX to choose)")


# A context a request asks for (Ollama's num_ctx) above the automatic one is loaded when every slot's
# KV cache at that size (the draft's included) takes at most this share of the memory it would have:
# what is available now plus what the loaded KV cache gives back. One rule, asked both when a
# request wants more and when the load chooses (two rules that disagreed reloaded at each request).
GROW_SHARE = 0.5


def slots_kv(info: GGUFInfo, draft: GGUFInfo | None, n_slots: int, n_ctx: int) -> int:
    """The KV cache of `n_slots` slots of `n_ctx` tokens, the draft model's included."""
    return n_ctx * n_slots * (info.kv_bytes_per_token() + (draft.kv_bytes_per_token() if draft else 0))


def kv_refusal(kv: int, room: int) -> str | None:
    """Why a KV cache of `kv` bytes is not made in `room` bytes of memory (GROW_SHARE), or None."""
    if kv > room * GROW_SHARE:
        return f"need {kv // MB} MiB of KV cache, more than half of the {room // MB} MiB memory it would have"
    return None


def grow_refusal(info: GGUFInfo, draft: GGUFInfo | None, n_slots: int, want: int, available: int, freed: int = 0,
                 gpu_share: float = 0.0, vram_available: int | None = None, vram_freed: int = 0) -> str | None:
    """Why a context of `want` tokens per slot is not loaded (None: it is). `freed`: the loaded KV
    cache a reload gives back (0 when nothing is loaded). On a GPU, the offloaded layers' share of
    the KV cache (`gpu_share`) must fit the GPU's memory by the same rule."""
    kv = slots_kv(info, draft, n_slots, want)
    if why := kv_refusal(kv, available + freed):
        return f"{n_slots} slots of {want} tokens {why}"
    if gpu_share > 0 and vram_available is not None:
        on_gpu, vroom = int(kv * gpu_share), vram_available + vram_freed
        if on_gpu > vroom * GROW_SHARE:
            return (f"the GPU's share of that KV cache, {on_gpu // MB} MiB, is more than half of the "
                    f"{vroom // MB} MiB GPU memory it would have")
    return None


def in_place_refusal(info: GGUFInfo, draft: GGUFInfo | None, n_slots: int, want: int, available: int) -> str | None:
    """Why a loaded model's context is not grown in place (backends/llamacpp/growth.py) but loaded
    again (None: it is grown in place). In place, the slots' KV states are held in memory while the
    old context is freed and the new one made: at worst every slot was full, so the new KV cache must
    fit in what is available now, as a reload's would not need to."""
    kv = slots_kv(info, draft, n_slots, want)
    if kv > available:
        return (f"its new KV cache, {kv // MB} MiB, would not fit in the {available // MB} MiB available while "
                "the slots' states are held")
    return None


def available_bytes() -> int:
    return int(psutil.virtual_memory().available)


def combined_estimate(info: GGUFInfo, draft: GGUFInfo | None, n_ctx: int, n_slots: int,
                      flash_attn: bool = True) -> Estimate:
    """A load's memory: the model's, plus its draft model's (same slots, always flash attention,
    draft_model.py) when it has one."""
    est = estimate(info, n_ctx, n_slots, flash_attn)
    if draft is not None:
        d = estimate(draft, n_ctx, n_slots, flash_attn=True)
        est = Estimate(est.weights + d.weights, est.kv + d.kv, est.compute + d.compute, n_ctx, n_slots)
    return est


def check_fit(name: str, info: GGUFInfo, n_ctx: int, n_slots: int, available: int | None = None,
              draft: GGUFInfo | None = None, flash_attn: bool = True) -> Estimate:
    """Raise DoesNotFit, with the numbers and the ways out, when the load would not fit in RAM.
    A paired draft model loads in the same worker with the same slots: it counts too, with flash
    attention whatever the target uses (draft_model.py), so without an attention scratch."""
    est = combined_estimate(info, draft, n_ctx, n_slots, flash_attn)
    avail = available_bytes() if available is None else available
    if est.total <= avail:
        return est
    per_ctx_token = n_slots * (info.kv_bytes_per_token() + (draft.kv_bytes_per_token() if draft else 0))
    room_for_kv = avail - est.weights - est.compute
    max_ctx = max(0, room_for_kv // per_ctx_token) // 256 * 256 if per_ctx_token else 0
    ways = []
    if max_ctx >= 256:
        ways.append(f"a context of at most {max_ctx} tokens per slot (LLMD_CTX={max_ctx})")
    if n_slots > 1:
        ways.append("fewer slots (LLMD_SLOTS)")
    ways.append("a smaller quantization of the model (llmd quantize, e.g. Q4_K_M)")
    if draft is not None:
        ways.append(f"no draft model (`llmd models pair {name} --none`)")
    raise DoesNotFit(
        f"loading {name} needs about {est.total / MB:.0f} MiB (weights {est.weights / MB:.0f} + KV cache "
        f"{est.kv / MB:.0f} for {n_slots} x {n_ctx} tokens + compute {est.compute / MB:.0f}) but only "
        f"{avail / MB:.0f} MiB is available; try " + ", or ".join(ways)
    )
