"""Cache and benchmark commands: `llmd cache stats|clear`, `llmd bench`."""

from __future__ import annotations

import argparse

from llmd.cli._common import AddCommand, client_of, mib, print_json, settings_of


def cmd_cache(args: argparse.Namespace) -> int:
    client = client_of(args)
    if args.action == "clear":
        both = not args.responses and not args.prefixes
        r = client.cache_clear(responses=both or args.responses, prefixes=both or args.prefixes)
        print(", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in r.items()) or "nothing to clear")
        return 0
    st = client.cache_stats()
    if args.json:
        return print_json(st)
    r, p = st["responses"], st["prefixes"]
    if r.get("enabled") is False:
        print("response cache: off")
    else:
        print(f"response cache: {r['entries']} replies, {mib(r['bytes'])} of {mib(r['max_bytes'])}; "
              f"hits {r['hits']}, misses {r['misses']}, bypassed {r['bypasses']} since start")
    print(f"prefix cache: {p['entries']} entries, {mib(p['bytes'])} of {mib(p['max_bytes'])}; "
          f"entries reused {p['entry_hits']} times")
    for name, e in (p.get("engines") or {}).items():
        if e:
            print(f"  {name}: {e['hits']} hits, {e['misses']} misses, {e['tokens_restored']} tokens restored, "
                  f"{e['saved']} saved")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import asyncio

    from llmd.bench import render, run_bench

    settings = settings_of(args)
    if args.json:
        report = asyncio.run(run_bench(settings.base_url, args.concurrency, args.requests, args.duration, args.mix,
                                       args.max_tokens, args.model))
        return print_json(report)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn()) as bar:
        task = bar.add_task(f"bench {args.mix}", total=args.requests)
        report = asyncio.run(run_bench(settings.base_url, args.concurrency, args.requests, args.duration, args.mix,
                                       args.max_tokens, args.model,
                                       progress=lambda done, total: bar.update(task, completed=done)))
    print(render(report))
    return 0 if report["errors"] == 0 else 1


def register(cmd: AddCommand) -> None:
    s = cmd("cache", cmd_cache, "response and prefix cache: stats, or clear [--responses] [--prefixes]")
    s.add_argument("action", nargs="?", choices=["stats", "clear"], default="stats")
    s.add_argument("--responses", action="store_true", help="clear only the response cache")
    s.add_argument("--prefixes", action="store_true", help="clear only the prefix KV cache")
    s.add_argument("--json", action="store_true")
    s = cmd("bench", cmd_bench, "load the daemon and report TTFT, inter-token latency, tokens/s, cache figures")
    s.add_argument("--concurrency", type=int, default=4)
    s.add_argument("--requests", type=int, help="stop after this many requests (default 20 unless --duration)")
    s.add_argument("--duration", type=float, help="stop after this many seconds")
    s.add_argument("--mix", choices=["chat", "long", "shared-prefix", "repeat"], default="chat")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--model")
    s.add_argument("--json", action="store_true")
