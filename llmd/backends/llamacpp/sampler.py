"""Native llama.cpp sampler chains, one per request: no Python-side sampling in the hot path."""

from __future__ import annotations

import json
import random
from typing import Any

from llmd.backends.base import Sampling
from llmd.errors import GrammarError


def grammar_for(response_format: dict[str, Any] | None) -> str | None:
    """GBNF for an OpenAI-style response_format ({"type": "json_object" | "json_schema" | "text"})."""
    if not response_format or response_format.get("type", "text") == "text":
        return None
    from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

    kind = response_format.get("type")
    if kind == "json_object":
        schema = response_format.get("schema")
        return json_schema_to_gbnf(json.dumps(schema)) if schema else JSON_GBNF
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise GrammarError("response_format.json_schema.schema must be a JSON schema object", "response_format")
        try:
            return json_schema_to_gbnf(json.dumps(schema))
        except Exception as e:  # the converter raises bare Exceptions on unsupported schemas
            raise GrammarError(f"cannot turn this JSON schema into a grammar: {e}", "response_format") from None
    raise GrammarError(
        f"response_format.type {kind!r} is not supported; use text, json_object or json_schema", "response_format"
    )


class SamplerChain:
    """Owns a llama_sampler chain; `sample(ctx, i)` samples and accepts the token of output row i."""

    def __init__(self, vocab: Any, n_vocab: int, sampling: Sampling, grammar: str | None) -> None:
        import llama_cpp as L

        self._L = L
        params = L.llama_sampler_chain_default_params()
        params.no_perf = True
        self.chain = L.llama_sampler_chain_init(params)
        add = lambda s: L.llama_sampler_chain_add(self.chain, s)  # noqa: E731
        if grammar is not None:
            g = L.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
            if not g:
                self.close()
                raise GrammarError("the grammar for response_format did not parse", "response_format")
            add(g)
        s = sampling
        if s.presence_penalty or s.frequency_penalty or s.repeat_penalty != 1.0:
            add(L.llama_sampler_init_penalties(n_vocab, 64, s.repeat_penalty, s.frequency_penalty, s.presence_penalty))
        if s.greedy:
            add(L.llama_sampler_init_greedy())
            return
        if s.top_k > 0:
            add(L.llama_sampler_init_top_k(s.top_k))
        if s.top_p < 1.0:
            add(L.llama_sampler_init_top_p(s.top_p, 1))
        if s.min_p > 0.0:
            add(L.llama_sampler_init_min_p(s.min_p, 1))
        add(L.llama_sampler_init_temp(s.temperature))
        seed = s.seed if s.seed is not None else random.getrandbits(32)
        add(L.llama_sampler_init_dist(seed % 0xFFFFFFFF))  # 0xFFFFFFFF would mean 'random'

    def sample(self, ctx: Any, row: int) -> int:
        return int(self._L.llama_sampler_sample(self.chain, ctx, row))

    def close(self) -> None:
        if self.chain:
            self._L.llama_sampler_free(self.chain)
            self.chain = None
