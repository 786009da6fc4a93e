"""The context per slot chosen at load (LLMD_CTX=auto): the trained context when a quarter of the
free memory holds every slot's KV cache, less (never under 4096) when it does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmd.config import fixed_ctx, load_settings
from llmd.models.gguf import GGUFInfo
from llmd.models.memory import AUTO_MIN_CTX, choose_ctx, load_ctx, starting_ctx

GIB = 1024 ** 3


def info(train: int, layers: int = 28, kv_heads: int = 2, head: int = 128) -> GGUFInfo:
    md = {"general.architecture": "qwen2", "qwen2.context_length": train, "qwen2.block_count": layers,
          "qwen2.attention.head_count": 12, "qwen2.attention.head_count_kv": kv_heads,
          "qwen2.embedding_length": 12 * head}
    return GGUFInfo(path=Path("m.gguf"), version=3, metadata=md, n_params=0, file_size=GIB, data_offset=0)


def test_the_trained_context_when_memory_holds_it():
    m = info(32768)  # 28 KiB of KV per token: 4 slots x 32k = 3.5 GiB, under a quarter of 20 GiB
    c = choose_ctx(m, 4, available=20 * GIB)
    assert c.n_ctx == 32768 and "trained context" in c.reason and "3584 MiB" in c.reason


def test_less_on_a_machine_with_less_memory_with_the_numbers():
    c = choose_ctx(info(32768), 4, available=8 * GIB)  # a quarter is 2 GiB: 18k tokens per slot
    assert c.n_ctx == 18432 and "trained for 32768" in c.reason and "2048 MiB" in c.reason
    assert choose_ctx(info(32768), 4, available=GIB).n_ctx == AUTO_MIN_CTX  # never below the old default


def test_a_draft_model_counts_and_a_short_model_keeps_its_own():
    alone = choose_ctx(info(32768), 4, available=16 * GIB).n_ctx
    paired = choose_ctx(info(32768), 4, available=16 * GIB, draft=info(32768, layers=24, head=64)).n_ctx
    assert paired < alone == 32768
    assert choose_ctx(info(2048), 4, available=GIB).n_ctx == 2048  # trained for less than the floor


def test_an_automatic_context_starts_small_and_says_what_it_grows_to():
    full = choose_ctx(info(32768), 4, available=20 * GIB)
    c = starting_ctx(full, 8192)
    assert c.n_ctx == 8192 and c.ceiling == 32768, c
    assert "to start" in c.reason and "grows up to 32768" in c.reason and "trained context" in c.reason
    assert starting_ctx(full, 0) == full  # LLMD_CTX_START=0: start at the automatic choice
    short = choose_ctx(info(4096), 4, available=20 * GIB)
    assert starting_ctx(short, 8192) == short and short.ceiling == 0  # trained for less: nothing to grow
    assert load_ctx(info(32768), 4, 0, 8192, available=20 * GIB) == c  # what a load starts with
    fixed = load_ctx(info(32768), 4, 16384, 8192, available=20 * GIB)
    assert fixed.n_ctx == 16384 and fixed.ceiling == 0  # LLMD_CTX: fixed, never grown


def test_fixed_wins_and_says_so():
    c = choose_ctx(info(8192), 4, fixed=16384, available=GIB)
    assert c.n_ctx == 16384 and "LLMD_CTX" in c.reason and "trained for 8192" in c.reason


def test_the_setting():
    assert fixed_ctx("auto") == 0 and fixed_ctx("8192") == 8192 and load_settings({}).ctx == "auto"
    with pytest.raises(ValueError, match="LLMD_CTX"):
        fixed_ctx("big")


def test_one_rule_decides_a_larger_context_asked_for_whether_loaded_or_loading():
    """num_ctx above the loaded context reloads only where the load that follows keeps it: the
    request's view (memory available now plus the loaded KV cache a reload frees) and the load's
    (memory available once it is freed) give the same answer. Two rules that disagreed reloaded the
    model at every request."""
    from llmd.models.memory import GROW_SHARE, MB, grow_refusal

    model = info(32768)
    per_token = 4 * model.kv_bytes_per_token()
    loaded_kv = 8192 * per_token
    for want in (16384, 32768, 65536):
        for free_now in (200 * MB, 1500 * MB, 3000 * MB, 6000 * MB):
            asked = grow_refusal(model, None, 4, want, free_now, freed=loaded_kv)
            at_load = grow_refusal(model, None, 4, want, free_now + loaded_kv)
            assert (asked is None) == (at_load is None), (want, free_now, asked, at_load)
    assert grow_refusal(model, None, 4, 32768, int(32768 * per_token / GROW_SHARE) + MB) is None
    why = grow_refusal(model, None, 4, 32768, int(32768 * per_token / GROW_SHARE) - MB)
    assert why and "more than half" in why
    # on a GPU, the offloaded layers' share must fit its memory too
    assert "GPU" in grow_refusal(model, None, 4, 32768, 64 * 1024 * MB, gpu_share=1.0, vram_available=100 * MB)


def test_growth_in_place_needs_the_new_kv_beside_the_held_states_else_the_model_reloads():
    """Growth in place holds every slot's KV state while it makes the new context: where a grow is
    allowed only because the reload would free the old KV cache, it reloads instead."""
    from llmd.models.memory import MB, grow_refusal, in_place_refusal

    model = info(32768)
    new_kv = 16384 * 4 * model.kv_bytes_per_token()
    assert in_place_refusal(model, None, 4, 16384, new_kv + MB) is None
    free_now = new_kv // 2
    assert grow_refusal(model, None, 4, 16384, free_now, freed=3 * new_kv) is None  # grows, by reloading
    why = in_place_refusal(model, None, 4, 16384, free_now)
    assert why and f"{new_kv // MB} MiB" in why and "states are held" in why


def test_a_draft_model_is_charged_no_attention_scratch_it_does_not_use():
    """The draft attends with flash attention whatever the target does (draft_model.py): a target
    attending by matrix products is charged its scores, the draft only its weights and KV."""
    from llmd.models.memory import attention_scratch, check_fit, estimate

    target, draft = info(32768), info(32768, layers=24, head=64)
    est = check_fit("m", target, 8192, 4, available=64 * GIB, draft=draft, flash_attn=False)
    alone = estimate(target, 8192, 4, flash_attn=False)
    assert est.compute - alone.compute == estimate(draft, 8192, 4, flash_attn=True).compute
    assert attention_scratch(8192, 12) > 0
