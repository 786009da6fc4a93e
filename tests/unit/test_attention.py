"""Which attention kernel a llama.cpp context uses (LLMD_FLASH_ATTN), and what attending without
flash attention costs in memory: the micro-batch is cut so the scores stay bounded, and the fit
check counts them."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmd.backends.llamacpp.context import flash_attention
from llmd.backends.llamacpp.prefix_store import namespace
from llmd.backends.llamacpp.prompt_rows import MIN_PROMPT_ROWS, PromptRows
from llmd.config import load_settings
from llmd.models.gguf import GGUFInfo
from llmd.models.memory import (
    ATTN_SCRATCH,
    MAX_UBATCH,
    MIN_UBATCH,
    attention_rows,
    attention_scratch,
    attention_ubatch,
    estimate,
)

MIB = 1024 ** 2


def info(train: int = 32768, heads: int = 12) -> GGUFInfo:
    md = {"general.architecture": "qwen2", "qwen2.context_length": train, "qwen2.block_count": 28,
          "qwen2.attention.head_count": heads, "qwen2.attention.head_count_kv": 2,
          "qwen2.embedding_length": heads * 128, "tokenizer.ggml.tokens": 151936}
    return GGUFInfo(path=Path("m.gguf"), version=3, metadata=md, n_params=0, file_size=1000 * MIB, data_offset=0)


def test_auto_attends_by_matrix_products_on_the_cpu_under_the_fast_policy_and_on_keeps_the_kernel():
    assert flash_attention("auto", exact=False, gpu_layers=0) is False
    assert flash_attention("auto", exact=True, gpu_layers=0) is True
    assert flash_attention("auto", exact=False, gpu_layers=99) is True
    assert flash_attention("on", exact=False, gpu_layers=0) is True
    assert flash_attention("off", exact=False, gpu_layers=0) is False
    assert flash_attention("off", exact=True, gpu_layers=0) is True  # its batch-invariance rules need it
    assert flash_attention("off", exact=False, gpu_layers=99) is True  # the GPU: less memory, faster


def test_the_setting_is_checked():
    assert load_settings({}, env={}).flash_attn == "auto"
    assert load_settings(env={"LLMD_FLASH_ATTN": "off"}).flash_attn == "off"
    with pytest.raises(ValueError, match="LLMD_FLASH_ATTN='fast': use auto, on or off"):
        load_settings(env={"LLMD_FLASH_ATTN": "fast"})


def test_the_micro_batch_bounds_the_scores_held_at_once():
    # the 1.5B at its trained 32,768 tokens a slot: 512 would hold 768 MiB of scores
    assert attention_ubatch(32768, 12) == 64
    assert attention_scratch(32768, 12) == 32768 * 64 * 12 * 4 <= ATTN_SCRATCH
    assert attention_ubatch(2048, 9) == MAX_UBATCH  # a short context keeps the largest
    assert attention_ubatch(10 ** 6, 64) == MIN_UBATCH  # never below the floor, even past the bound
    for n_ctx in (4096, 8192, 16384, 32768, 131072):
        ub = attention_ubatch(n_ctx, 28)
        assert ub & (ub - 1) == 0 and (ub == MIN_UBATCH or n_ctx * ub * 28 * 4 <= ATTN_SCRATCH)


def test_a_cold_prompt_is_read_in_the_largest_micro_batches_its_depth_allows():
    """Issue 51: the scores a step holds grow with the cells filled so far, not the slot's size, so
    a prompt starts in micro-batches of 512 and takes fewer rows as it grows."""
    assert attention_rows(1000, 12) == MAX_UBATCH  # 1,024 cells x 512 rows x 12 heads: 24 MiB
    assert attention_rows(8192, 12) == 256
    assert attention_rows(32768, 12) == attention_ubatch(32768, 12) == 64
    assert attention_rows(5400, 12) == attention_rows(5632, 12)  # padded to 256 cells, as llama.cpp does
    last = MAX_UBATCH
    for depth in range(1, 200_000, 997):  # never more rows deeper in, never past the bound or the floor
        rows = attention_rows(depth, 12)
        assert rows <= last and (rows == MIN_UBATCH or (-(-depth // 256) * 256) * rows * 12 * 4 <= ATTN_SCRATCH)
        last = rows


def test_a_step_beside_decoding_streams_keeps_some_prompt_rows():
    """The engine cuts a prompt's piece by the room its depth leaves (PromptRows.room), never to
    fewer than MIN_PROMPT_ROWS, and says up to which depth a prompt is read in whole micro-batches."""
    rows = PromptRows(flash_attn=False, n_batch=512, n_head=12, n_ctx=32768)
    assert rows.room(0, 1000) == 512
    assert rows.room(4, 1000) == 508
    assert rows.room(0, 30000) == 64
    assert rows.room(100, 30000) == MIN_PROMPT_ROWS
    depth = rows.full_depth()
    assert attention_rows(depth, 12) == 512 and attention_rows(depth + 256, 12) < 512
    assert rows.info() == f"matmul (micro-batches of 512, fewer past {depth} tokens)"
    assert PromptRows(False, 512, 12, 2560).info() == "matmul (micro-batches of 512)"
    flash = PromptRows(flash_attn=True, n_batch=512, n_head=12, n_ctx=32768)
    assert flash.info() == "flash" and flash.room(100, 30000) >= 512 and flash.end(100, 0, 99) == 99


def test_the_fit_check_counts_the_scores_without_flash_attention():
    m = info()
    with_fa, without = estimate(m, 32768, 4), estimate(m, 32768, 4, flash_attn=False)
    assert without.kv == with_fa.kv and without.compute - with_fa.compute == attention_scratch(32768, 12)


def test_prefix_cache_entries_of_the_two_kernels_never_mix():
    """Without flash attention llama.cpp stores V transposed: a saved state of one layout cannot be
    restored into the other, so the two are separate namespaces."""
    assert namespace("d", 64, "fast", "f16") != namespace("d", 64, "fast", "f16-vt")


def test_a_prompt_piece_never_leaves_its_last_token_alone_in_a_micro_batch():
    """Without flash attention a prompt's last token computed alone gets other logits (prompt_rows.LAST_ROWS)."""
    def ends(n: int, start: int, end: int) -> int:
        return PromptRows(flash_attn=False, n_batch=64, n_head=12, n_ctx=2048).end(n, start, end)

    assert ends(100, 0, 99) == 98  # one token would be left: two go together next step
    assert ends(100, 0, 100) == 100
    assert ends(65, 0, 65) == 63  # 64 + a lone row in the last micro-batch: 63 now, 2 next
    assert ends(100, 98, 99) == 99  # a one-token budget: the prompt goes on anyway
    assert ends(37, 36, 37) == 37  # one row is all that is left: computed (admission leaves two)
