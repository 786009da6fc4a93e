"""Speculation is exact: every emitted token is the target's own sample.

In-process, with the real models: the target is SmolLM2 re-encoded to F16, the draft model is the
shipped Q4_1 (same vocabulary). A recording sampler keeps the logits each sample was drawn from.
- Short contexts (under 100 tokens of prompt): each drafter gives the same greedy text as off.
- Longer contexts: wherever a speculative run and the plain run part, they had the same tokens
  before, so the logits at that position differ only by the kernels' batch-shape numerics
  (DESIGN: Determinism). Both must hold there: the logits differ by at most DELTA_MAX, and for
  greedy, the plain run's top two were within GAP_MAX (a near-tie). A logic bug (a wrong
  position, a stale KV row, an unverified draft) parts the runs at clear winners instead.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_speculation import CODE  # the function the copying prompts repeat

from llmd.backends.base import EngineConfig, FinalEvent, GenerationRequest, Sampling
from llmd.backends.llamacpp import prepare as prepare_mod
from llmd.backends.llamacpp.engine import LlamaCppEngine
from llmd.backends.llamacpp.sampler import SamplerChain
from llmd.backends.repack import repack_for
from llmd.models.catalog import find_packaged
from llmd.models.quantize import plan, quantize

pytestmark = pytest.mark.integration

# Bounds, from measurements on this machine (README, "Speculation"): where runs parted, the
# logits differed by at most 0.07 and the plain run's top-two gap was 0.007; a clear winner leads
# by a logit or more. 0.25 leaves room for other CPUs' kernels and still catches a logic bug.
DELTA_MAX = 0.25
GAP_MAX = 0.25

SHORT = [
    ("Repeat this code exactly:\n" + CODE, 120),
    ("Summarize in one sentence: The lighthouse was lit in 1821 and automated in 1965.", 60),
    ("Tell me about cats.", 60),
    ("Reply with a JSON object with the keys name and age of a dog.", 60),
    ("Write a long story about a robot who learns to paint.", 320),
]
LONG_TEXT = " ".join([
    "The harbour town of Port Elspeth grew around a lighthouse built in 1821 on the Skerry Rocks.",
    "Its first keeper, Agnes Morrow, trimmed the wicks of twelve oil lamps every evening and wound the",
    "clockwork that turned the lens every four hours. Fishing boats, coal ships from the north and the",
    "weekly mail packet relied on the light. In 1893 a storm drove the schooner Marigold onto the rocks,",
    "and keeper Elias Dunn rowed out twice through the surf to save nine sailors. The town raised money",
    "for a lifeboat station the following spring. In 1907 a frost cracked the great Fresnel lens, and a",
    "replacement came by rail from Birmingham in eleven crates. Electric light arrived in 1954, when",
    "Tobias Wren switched on the new beacon, and the tower was automated in 1965. Today the keepers'",
    "cottages hold a museum with their logbooks, a tea room that serves scones on Sundays, and a shop",
    "that sells postcards of the tower in every season.",
] * 2)


class Recorder(SamplerChain):
    """A sampler chain that also keeps (token, logits) for every sample it draws."""

    traces: dict[str, list[tuple[int, np.ndarray]]] = {}
    current = ""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.trace: list[tuple[int, np.ndarray]] = []
        Recorder.traces[Recorder.current] = self.trace

    def sample(self, ctx: Any, row: int) -> int:
        n_vocab = self._L.llama_vocab_n_tokens(self._L.llama_model_get_vocab(self._L.llama_get_model(ctx)))
        ptr = self._L.llama_get_logits_ith(ctx, row)
        logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,)).copy()
        token = super().sample(ctx, row)
        self.trace.append((token, logits))
        return token


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaCppEngine]:
    d = tmp_path_factory.mktemp("spec")
    draft = find_packaged(d / "models")["smollm2-135m"]
    target = quantize(plan(Path(draft), d / "smollm2-f16.gguf", "F16"))
    mp = pytest.MonkeyPatch()
    mp.setattr(prepare_mod, "SamplerChain", Recorder)
    e = LlamaCppEngine(EngineConfig(model_path=str(target), model_name="smollm2-f16", n_ctx=2048, n_slots=2,
                                    chunk=64, draft_path=str(draft),
                                    repack=repack_for([str(target), str(draft)])))
    run(e, "off", "Repeat this code exactly:\n" + CODE, 40, "ngram")  # so t(k) gets measured
    while e.has_work():
        e.step()
    assert e.spec.cost, "the verification cost was not measured"
    yield e
    e.close()
    mp.undo()


def run(e: LlamaCppEngine, tag: str, content: str, max_tokens: int, mode: str,
        sampling: Sampling | None = None) -> tuple[list[int], list[np.ndarray], Any]:
    Recorder.current = f"{tag}-{mode}-{time.perf_counter()}"
    req = GenerationRequest(id=Recorder.current, messages=[{"role": "user", "content": content}],
                            max_tokens=max_tokens, sampling=sampling or Sampling(temperature=0.0),
                            speculation=mode, cache_prompt=False)
    e.submit(req)
    while True:
        for ev in e.step():
            if isinstance(ev, FinalEvent):
                trace = Recorder.traces.pop(Recorder.current)
                return [t for t, _ in trace], [lg for _, lg in trace], ev.usage
            assert not hasattr(ev, "error"), ev


def parting(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top_two_gap(logits: np.ndarray) -> float:
    top = np.partition(logits, -2)[-2:]
    return float(top[1] - top[0])


@pytest.mark.parametrize("mode", ["ngram", "draft", "auto"])
@pytest.mark.parametrize("content,max_tokens", SHORT, ids=["copy", "summary", "chat", "json", "long"])
def test_greedy_equals_off_on_short_contexts(engine: LlamaCppEngine, mode: str, content: str, max_tokens: int):
    off, _, _ = run(engine, "off", content, max_tokens, "off")
    spec, _, usage = run(engine, "spec", content, max_tokens, mode)
    assert spec == off
    if mode == "draft":
        assert usage.drafted_tokens > 0 and usage.accepted_tokens > 0


@pytest.mark.parametrize("sampling", [Sampling(temperature=0.0), Sampling(temperature=0.8, seed=7)],
                         ids=["greedy", "seeded-0.8"])
@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_long_contexts_part_only_at_near_ties(engine: LlamaCppEngine, mode: str, sampling: Sampling,
                                              record_property: Any):
    content = "Retell this history in your own words, in detail:\n" + LONG_TEXT
    off, off_logits, u = run(engine, "off", content, 200, "off", sampling)
    assert u.prompt_tokens > 250
    spec, spec_logits, su = run(engine, "spec", content, 200, mode, sampling)
    assert su.drafted_tokens > 0
    i = parting(off, spec)
    if i is None:
        record_property("parted", "no")
        return
    delta = float(np.abs(off_logits[i] - spec_logits[i]).max())
    gap = top_two_gap(off_logits[i])
    record_property("parted", f"at token {i}: logits differ by {delta:.4f}, plain top-two gap {gap:.4f}")
    print(f"{mode} {sampling.temperature}: parted at token {i} of {len(off)}; max logit delta {delta:.4f}, "
          f"plain top-two gap {gap:.4f}")
    assert delta <= DELTA_MAX, f"parted at token {i} with logits {delta:.3f} apart: not numerics, a bug"
    if sampling.greedy:
        assert gap <= GAP_MAX, f"parted at token {i} where the plain run's winner led by {gap:.3f}: a bug"


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_seeded_sampling_parts_only_where_logits_moved(engine: LlamaCppEngine, mode: str, record_property: Any):
    """Seeded sampling draws one random number per emitted token in either mode, so the runs agree
    until a multi-row verification moves a logit: measured with this F16 target, by ~0.02 even on a
    38-token prompt, enough to flip a sample that lands near a boundary. (With the Q4_1 target the
    short-context runs are identical: tests/integration/test_speculation.py.)"""
    s = Sampling(temperature=0.8, seed=11)
    off, off_logits, _ = run(engine, "off", "Write a short poem about the sea.", 60, mode="off", sampling=s)
    spec, spec_logits, _ = run(engine, "spec", "Write a short poem about the sea.", 60, mode, s)
    i = parting(off, spec)
    if i is not None:
        delta = float(np.abs(off_logits[i] - spec_logits[i]).max())
        record_property("parted", f"at token {i}: logits differ by {delta:.4f}")
        assert delta <= DELTA_MAX, f"parted at token {i} with logits {delta:.3f} apart: not numerics, a bug"
