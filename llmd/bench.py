"""`llmd bench`: a bounded load generator against the local daemon, with a report.

Streams chat completions from `concurrency` clients until `requests` are done or `duration`
has passed, records TTFT and inter-token gaps as a client sees them, and reads the daemon's
own counters (/metrics) before and after to report cache and draft figures for the run.
Loopback only: it refuses to load any other host.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from llmd.daemon.security import LOOPBACK_NAMES

MAX_REQUESTS = 100_000
MAX_DURATION_S = 3600.0

_TOPICS = ["rivers", "bees", "volcanoes", "trains", "tea", "owls", "glaciers", "jazz", "bridges", "comets"]
_SHARED = ("You are a support assistant for a bicycle shop. The shop sells road, gravel and city bikes, "
           "repairs all brands, and is open from nine to six on weekdays. " * 12)


def prompt_for(mix: str, i: int) -> list[dict[str, str]]:
    topic = _TOPICS[i % len(_TOPICS)]
    if mix == "chat":
        return [{"role": "user", "content": f"({uuid.uuid4().hex[:6]}) Tell me something about {topic}."}]
    if mix == "long":
        return [{"role": "user", "content": f"Summarize: {'The ' + topic + ' of the valley are old and quiet. ' * 60}"}]
    if mix == "shared-prefix":
        return [{"role": "system", "content": _SHARED}, {"role": "user", "content": f"Question {i}: about {topic}?"}]
    if mix == "repeat":
        return [{"role": "user", "content": f"Tell me something about {topic}."}]
    raise ValueError(f"unknown mix {mix!r}; use chat, long, shared-prefix or repeat")


MIXES = ("chat", "long", "shared-prefix", "repeat")


@dataclass
class Result:
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None
    cache: str = ""


def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


async def _one(client: httpx.AsyncClient, model: str | None, mix: str, i: int, max_tokens: int) -> Result:
    body: dict[str, Any] = {"messages": prompt_for(mix, i), "max_tokens": max_tokens, "stream": True,
                            "temperature": 0, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    res = Result()
    t0 = time.perf_counter()
    last = t0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            res.cache = r.headers.get("X-LLMD-Cache", "")
            if r.status_code != 200:
                await r.aread()
                res.error = f"{r.status_code}: {r.text[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                if chunk.get("usage"):
                    res.tokens = chunk["usage"]["completion_tokens"]
                for ch in chunk.get("choices", []):
                    if (ch.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - t0
                        else:
                            res.gaps.append(now - last)
                        last = now
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _counters(base_url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    text = httpx.get(base_url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name
            if s.name == "llmd_requests_total":
                key += "_" + s.labels.get("outcome", "")
            if s.name == "llmd_response_cache_total":
                key += "_" + s.labels.get("result", "")
            out[key] = out.get(key, 0.0) + s.value
    return out


async def run_bench(base_url: str, concurrency: int, requests: int | None, duration: float | None, mix: str,
                    max_tokens: int, model: str | None = None, progress: Any = None) -> dict[str, Any]:
    host = urlsplit(base_url).hostname or ""
    if host not in LOOPBACK_NAMES and not host.endswith(".localhost"):
        raise ValueError(f"llmd bench only targets loopback addresses, not {host!r}")
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; use {', '.join(MIXES)}")
    limit = min(requests or MAX_REQUESTS, MAX_REQUESTS)
    deadline = time.monotonic() + min(duration or MAX_DURATION_S, MAX_DURATION_S)
    before = _counters(base_url)
    results: list[Result] = []
    issued = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal issued
        while issued < limit and time.monotonic() < deadline:
            i = issued
            issued += 1
            results.append(await _one(client, model, mix, i, max_tokens))
            if progress is not None:
                progress(len(results), limit if requests else None)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600, connect=5)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    after = _counters(base_url)

    def delta(k: str) -> int:
        return int(after.get(k, 0) - before.get(k, 0))

    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    generated = sum(r.tokens for r in ok)
    drafted, accepted = delta("llmd_drafted_tokens_total"), delta("llmd_accepted_tokens_total")
    return {
        "mix": mix, "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
        "error_examples": [r.error for r in results if r.error][:3], "wall_s": round(wall, 3),
        "ttft_s": {"p50": _pct(ttfts, 0.5), "p95": _pct(ttfts, 0.95), "p99": _pct(ttfts, 0.99)},
        "inter_token_s": {"p50": _pct(gaps, 0.5), "p95": _pct(gaps, 0.95), "p99": _pct(gaps, 0.99)},
        "generated_tokens": generated, "tokens_per_s": round(generated / wall, 2) if wall > 0 else 0.0,
        "daemon": {
            "requests_ok": delta("llmd_requests_total_ok"),
            "generated_tokens": delta("llmd_generated_tokens_total"),
            "response_cache_hits": delta("llmd_response_cache_total_hit"),
            "response_cache_misses": delta("llmd_response_cache_total_miss"),
            "cached_prompt_tokens": delta("llmd_cached_prompt_tokens_total"),
            "prompt_tokens": delta("llmd_prompt_tokens_total"),
            "prefix_cache_hits": delta("llmd_prefix_cache_hits_total"),
            "drafted_tokens": drafted, "accepted_tokens": accepted,
            "draft_acceptance": round(accepted / drafted, 3) if drafted else None,
        },
    }


def render(report: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f} ms"

    t, g, d = report["ttft_s"], report["inter_token_s"], report["daemon"]
    lines = [
        f"{report['requests']} requests ({report['errors']} errors), mix {report['mix']}, "
        f"concurrency {report['concurrency']}, {report['wall_s']:.1f} s",
        f"TTFT          p50 {ms(t['p50'])}  p95 {ms(t['p95'])}  p99 {ms(t['p99'])}",
        f"inter-token   p50 {ms(g['p50'])}  p95 {ms(g['p95'])}  p99 {ms(g['p99'])}",
        f"throughput    {report['tokens_per_s']:.1f} tokens/s ({report['generated_tokens']} tokens)",
        f"daemon        {d['requests_ok']} ok, response cache {d['response_cache_hits']} hits / "
        f"{d['response_cache_misses']} misses, prompt tokens reused {d['cached_prompt_tokens']} of "
        f"{d['prompt_tokens']}, prefix restores {d['prefix_cache_hits']}, drafts accepted "
        f"{d['accepted_tokens']} of {d['drafted_tokens']}",
    ]
    lines += [f"error: {e}" for e in report["error_examples"]]
    return "\n".join(lines)
