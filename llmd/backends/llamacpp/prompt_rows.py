"""How many of a prompt's rows one engine step takes, and where a piece of a prompt may end: the
rules of llama.cpp's two attention kernels in one place (issue 49: they were in the engine and in
admission; issue 51: a cold prompt was read 64 rows at a time).

Flash attention holds no scores: a step takes what the budget gives it, in micro-batches of the
whole batch. Matrix-product attention holds one micro-batch's scores against the cells a sequence
has filled (models/memory.py's attention_rows bounds them), so a step's rows are cut by the depth
they reach, and a prompt's last token is never computed alone in a micro-batch (LAST_ROWS).
"""

from __future__ import annotations

from llmd.models.memory import KV_PAD, MAX_UBATCH, attention_rows

# Without flash attention llama.cpp computes a micro-batch holding one row of a sequence by another
# kernel than one holding several (its matrix-product kernel needs two), and the attention of that
# row comes out different: a prompt's last token computed alone after its prefix was reused gave
# logits up to 0.52 away from the ones it got in the prompt's batch (SmolLM2, 37 tokens; two rows
# or more: identical), so the same seeded request gave another text warm than cold. The fast
# policy then computes at least this many of a prompt's last tokens together.
LAST_ROWS = 2
MIN_PROMPT_ROWS = 16  # the fewest prompt rows a step may take beside decoding streams (room)


class PromptRows:
    def __init__(self, flash_attn: bool, n_batch: int, n_head: int, n_ctx: int) -> None:
        self.flash_attn = flash_attn
        self.n_head = n_head
        self.n_ctx = n_ctx
        # the micro-batch llama.cpp is given: with matrix products at most MAX_UBATCH, which a step
        # then cuts by depth (a cold prompt read in 512s while short went 1.2-1.3x faster than in
        # the 64 a whole 32k slot allows: benchmarks/attention.py --prefill)
        self.n_ubatch = n_batch if flash_attn else min(n_batch, MAX_UBATCH)

    @property
    def last_rows(self) -> int:
        """How many of a prompt's last tokens are computed in the step that samples."""
        return 1 if self.flash_attn else LAST_ROWS

    def room(self, n: int, deepest: int) -> int:
        """Prompt rows a step already holding `n` rows may add when its deepest sequence reaches
        `deepest` cells (their scores stay within ATTN_SCRATCH); never under MIN_PROMPT_ROWS, so
        decoding streams cannot starve a prompt. Unbounded with flash attention."""
        if self.flash_attn:
            return 1 << 30
        return max(MIN_PROMPT_ROWS, attention_rows(deepest, self.n_head) - n)

    def end(self, n_prompt: int, start: int, end: int) -> int:
        """Where a prompt's piece [start, end) ends so that its last token is not computed alone in
        a micro-batch (LAST_ROWS): neither one token left for a later step nor a piece whose last
        micro-batch holds one row (as a lone prefill is split). A piece that would then be empty
        (a budget of one token) keeps its end: the prompt goes on."""
        if self.flash_attn:
            return end
        cut = end
        if 0 < n_prompt - cut < LAST_ROWS:
            cut = n_prompt - LAST_ROWS
        if cut == n_prompt and cut - start > 1 and (cut - start) % self.n_ubatch == 1:
            cut -= LAST_ROWS  # the rest goes together in the next step
        return cut if cut > start else end

    def full_depth(self) -> int:
        """The depth up to which a prompt is still read in micro-batches of n_ubatch."""
        if self.flash_attn:
            return self.n_ctx
        depth = KV_PAD
        while attention_rows(depth + KV_PAD, self.n_head) >= self.n_ubatch and depth < self.n_ctx:
            depth += KV_PAD
        return depth

    def info(self) -> str:
        """The kernel and its micro-batches, for status (and the response cache's key)."""
        if self.flash_attn:
            return "flash"
        full = self.full_depth()
        if full >= self.n_ctx:
            return f"matmul (micro-batches of {self.n_ubatch})"
        return f"matmul (micro-batches of {self.n_ubatch}, fewer past {full} tokens)"
