"""The `llmd` command. Exit codes: 0 ok, 1 failure, 2 usage (argparse)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

from llmd import __version__
from llmd.config import Settings, describe, load_settings


def _settings(args: argparse.Namespace, **extra: Any) -> Settings:
    return load_settings({"host": getattr(args, "host", None), "port": getattr(args, "port", None), **extra})


def _client(args: argparse.Namespace) -> Any:
    from llmd.client import Client

    return Client(_settings(args))


def _print_json(obj: Any) -> int:
    print(json.dumps(obj, indent=2))
    return 0


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 1024 / 1024:.0f} MiB"


# ---- daemon lifecycle -------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from llmd.daemon.server import serve
    from llmd.logs import setup

    settings = _settings(args, model=args.model, ctx=args.ctx, slots=args.slots, backend=args.backend)
    setup(settings.paths.log_file)
    logging.getLogger("llmd.server").info("settings", extra={"settings": settings.as_dict()})
    serve(settings)
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    """Start the daemon detached; return once it is healthy, or say why not."""
    from llmd.client import DaemonNotRunning

    settings = _settings(args)
    client = _client(args)
    try:
        client.health()
        print(f"llmd is already running at {settings.base_url}")
        return 0
    except DaemonNotRunning:
        pass
    settings.paths.ensure()
    log_path = settings.paths.logs / "daemon.out"
    cmd = [sys.executable, "-m", "llmd", "serve"]
    if args.host:
        cmd += ["--host", args.host]
    if args.port:
        cmd += ["--port", str(args.port)]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            print(f"llmd: the daemon exited with code {proc.returncode}:\n  " + "\n  ".join(tail), file=sys.stderr)
            return 1
        try:
            client.health()
            print(f"llmd started at {settings.base_url} (pid {proc.pid}); logs in {log_path}")
            return 0
        except DaemonNotRunning:
            time.sleep(0.1)
    print(f"llmd: the daemon did not answer within {args.timeout:.0f}s; see {log_path}", file=sys.stderr)
    return 1


def cmd_stop(args: argparse.Namespace) -> int:
    settings = _settings(args)
    pid_file = settings.paths.pid_file
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        print(f"llmd is not running (no pid file at {pid_file})")
        return 0
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pid_file.unlink(missing_ok=True)
        print("llmd was not running (removed a stale pid file)")
        return 0
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            print(f"llmd stopped (pid {pid})")
            return 0
        time.sleep(0.1)
    print(f"llmd: pid {pid} did not stop within {args.timeout:.0f}s; `kill -9 {pid}` forces it", file=sys.stderr)
    return 1


# ---- status -----------------------------------------------------------------------------------


def cmd_doctor(args: argparse.Namespace) -> int:
    """Runs here, without the daemon: the same probe and choice the daemon makes."""
    from llmd.backends.select import choose, formats_of, probe
    from llmd.config import SETTINGS
    from llmd.models.registry import Registry

    settings = _settings(args)
    settings.paths.ensure()
    p = probe()
    registry = Registry(settings.paths.registry_db, settings.paths.models_dir)
    registry.sync_packaged()
    row = registry.get(settings.model)
    override = None if settings.backend == "auto" else settings.backend
    choice = choose(p, formats_of(row, settings.ctx, settings.slots), override)
    from llmd.backends.repack import RepackRecord

    record = RepackRecord(settings.paths.repack_record)
    repack = record.decide(settings.repack, (row["quantization"],)) if row["format"] == "gguf" else None
    if args.json:
        return _print_json({"machine": p.as_dict(), "model": settings.model, "choice": choice.as_dict(),
                            "repack": {"mode": settings.repack, "kind": record.kind,
                                       "decision": repack.as_dict() if repack else None, "records": record.here()},
                            "settings": settings.as_dict()})
    gib = 1024**3
    print(f"machine:  {p.os}, {p.arch}, {p.cpu} ({p.physical_cores} cores / {p.logical_cores} threads; "
          f"{', '.join(p.cpu_features) or 'no SIMD flags read'})")
    print(f"memory:   {p.ram_available / gib:.1f} GiB available of {p.ram_total / gib:.1f} GiB")
    if p.gpus:
        for g in p.gpus:
            print(f"gpu:      {g.name}, compute capability {g.compute_capability[0]}.{g.compute_capability[1]}, "
                  f"{g.free_vram / gib:.1f} of {g.total_vram / gib:.1f} GiB free, driver {g.driver}")
    else:
        print(f"gpu:      none ({p.nvml})")
    print(f"tensorrt_llm: {p.tensorrt_llm or 'not installed'}" + (f" ({p.tensorrt_llm_error})"
                                                                  if p.tensorrt_llm_error else ""))
    print(f"llama.cpp GPU offload: {'yes' if p.llama_gpu_offload else 'no (CPU build)'}")
    print(f"\nfor {settings.model}: {choice.backend} {choice.precision}"
          + (f", {choice.gpu_layers} layers on {choice.gpu}" if choice.gpu_layers else ""))
    for r in choice.reasons:
        print(f"  because {r}")
    for option, why in choice.rejected:
        print(f"  not {option}: {why}")
    if repack is not None:
        print(f"weight repacking ({record.kind}): {'on' if repack.repack else 'off'} ({repack.reason})")
    for entry in record.here():
        print(f"  recorded {entry.get('when')}: {entry.get('reason')} [{entry.get('file_type')}, "
              f"llama-cpp-python {entry.get('llama_cpp')}]")
    print("\nsettings:")
    values = settings.as_dict()
    for s in SETTINGS:
        print(f"  {s.env:<24} {values[s.name]!r}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    status = _client(args).status()
    if args.json:
        return _print_json(status)
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"llmd {status['version']} [green]running[/] at {status['address']}, pid {status['pid']}, "
                  f"up {status['uptime_s']:.0f}s")
    b = status["backend"]
    console.print(f"backend: {b['name']} ({b['precision']}): {b['reason']}")
    console.print(f"active model: {status['active_model']}; requests running or queued: "
                  f"{status['requests_in_flight']} (limit {status['capacity']}); "
                  f"memory available: {_mib(status['memory_available'])}")
    console.print(f"speculation for requests that name none: {status.get('speculation', '?')}")
    table = Table("model", "pid", "memory", "slots busy", "queued", "ctx/slot", "step ms", "unloads")
    for m in status["loaded"]:
        st = m.get("stats") or {}
        exp = m.get("expires_at")
        table.add_row(m["name"], str(m["pid"]), _mib(m.get("memory_estimate", {}).get("total")),
                      f"{st.get('slots_busy', '?')}/{st.get('slots', '?')}", str(st.get("waiting", "?")),
                      str(m.get("n_ctx")), str(st.get("step_ms_p50")),
                      "never" if exp is None else f"in {max(0, exp - time.time()):.0f}s")
    console.print(table if status["loaded"] else "no model loaded")
    for m in status["loaded"]:
        spec = (m.get("stats") or {}).get("speculation")
        if spec:
            console.print(f"{m['name']}: draft model {m.get('draft') or 'none'}; accepted drafts: "
                          + _acceptance(spec))
        rp = m.get("repack") or {}
        console.print(f"{m['name']}: {m.get('policy', '?')} batching policy; weight repacking "
                      f"{'on' if rp.get('repack') else 'off'} ({rp.get('reason', '?')})")
    for name, why in (status.get("unavailable") or {}).items():
        console.print(f"[red]{name} unavailable[/]: {why}")
    if args.verbose:
        for m in status["loaded"]:
            prof = (m.get("stats") or {}).get("profile") or {}
            if not prof.get("enabled"):
                console.print(f"{m['name']}: profiling is off (start the daemon with LLMD_PROFILE=1)")
                continue
            console.print(f"{m['name']}: per-step timing")
            for name, p in prof.items():
                if name != "enabled":
                    console.print(f"  {name:12} {p['count']:8d} x {p['mean_ms']:8.3f} ms = {p['total_s']:.2f} s")
    return 0


def _acceptance(spec: dict[str, Any]) -> str:
    """'ngram 87% of 94, draft none yet': accepted share of drafted tokens since the model loaded."""
    parts = []
    for kind in ("ngram", "draft"):
        k = spec.get(kind) or {}
        parts.append(f"{kind} {k['accepted'] / k['drafted']:.0%} of {k['drafted']}" if k.get("drafted")
                     else f"{kind} none yet")
    return ", ".join(parts)


def cmd_ps(args: argparse.Namespace) -> int:
    loaded = _client(args).status()["loaded"]
    if args.json:
        return _print_json(loaded)
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "pid", "memory", "processor", "context", "until")
    for m in loaded:
        exp = m.get("expires_at")
        gpu = m.get("gpu_layers") or 0
        table.add_row(m["name"], str(m["pid"]), _mib(m.get("memory_estimate", {}).get("total")),
                      "100% CPU" if not gpu else f"{gpu} layers GPU", str(m.get("n_ctx")),
                      "forever" if exp is None else time.strftime("%H:%M:%S", time.localtime(exp)))
    Console().print(table)
    return 0


# ---- models -----------------------------------------------------------------------------------


def cmd_models(args: argparse.Namespace) -> int:
    action = args.action or "list"
    client = _client(args)
    if action == "list":
        models = client.models()
        if args.json:
            return _print_json(models)
        from rich.console import Console
        from rich.table import Table

        table = Table("name", "arch", "params", "quant", "size", "context", "loaded", "source")
        for m in models:
            mark = "active" if m["active"] else ("yes" if m["loaded"] else "")
            table.add_row(m["name"], m["arch"], f"{m['n_params'] / 1e6:.0f}M", m["quantization"], _mib(m["size"]),
                          str(m["context_length"]), mark, m["source"])
        Console().print(table)
        return 0
    if not args.name:
        print(f"llmd: `llmd models {action}` needs a model name (or a path for add)", file=sys.stderr)
        return 2
    if action == "show":
        m = client.model(args.name)
        if args.json:
            return _print_json(m)
        est = m["memory_estimate"]
        print(f"{m['name']}: {m['arch']}, {m['n_params'] / 1e6:.0f}M parameters, {m['quantization']} ({m['format']}), "
              f"context {m['context_length']}, chat template: {'yes' if m['has_chat_template'] else 'no'}")
        print(f"  {'file' if m['format'] == 'gguf' else 'folder'}: {m['path']} ({_mib(m['size'])}, {m['digest']})")
        if m.get("hf_path") and m["format"] == "gguf":
            print(f"  also a checkpoint for TensorRT-LLM: {m['hf_path']}")
        if est:
            print(f"  memory to load: {_mib(est['total'])} = weights {_mib(est['weights'])} + KV cache "
                  f"{_mib(est['kv'])} ({est['n_slots']} slots x {est['n_ctx']} tokens) + compute {_mib(est['compute'])}")
        if m.get("draft"):
            print(f"  draft model for speculation: {m['draft']}")
        if m.get("parent"):
            print(f"  quantized from {m['parent']} to {m['quant_type']}")
        if m.get("eval"):
            e = json.loads(m["eval"])
            line = f"  eval: perplexity {e['perplexity']:.3f} ({e['tokens_scored']} tokens, {e['text']} text)"
            if e.get("base"):
                line += (f"; vs {e['base']}: KL {e['kl_mean']:.5f}, top-1 {e['top1_agreement']:.1%}, "
                         f"ppl ratio {e['ppl_ratio']:.4f}")
            print(line)
        return 0
    if action == "add":
        m = client.add_model(os.path.abspath(args.name), args.as_name)
        print(f"added {m['name']}: {m['arch']}, {m['quantization']}, {_mib(m['size'])}")
        return 0
    if action == "pair":
        if not args.draft and not args.none:
            print("llmd: `llmd models pair TARGET DRAFT` needs a draft model (or --none to unpair)", file=sys.stderr)
            return 2
        r = client.pair(args.name, None if args.none else args.draft)
        what = f"{r['draft']} drafts for {r['model']}" if r["draft"] else f"{r['model']} has no draft model"
        print(what + ("; it reloads with the next request" if r["reloads"] else ""))
        return 0
    if action == "rm":
        r = client.remove_model(args.name)
        print(f"removed {r['removed']}" + (" and deleted the file llmd had made" if r["deleted_file"] else
                                            " (its file was left in place)"))
        return 0
    print(f"llmd: unknown models action {action!r}; use list, show, add, rm or pair", file=sys.stderr)
    return 2


def cmd_use(args: argparse.Namespace) -> int:
    r = _client(args).use(args.name)
    print(f"active model: {r['active_model']} (worker pid {r['pid']}, {r['switch_s']:.2f}s)")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.action == "clear":
        both = not args.responses and not args.prefixes
        r = client.cache_clear(responses=both or args.responses, prefixes=both or args.prefixes)
        print(", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in r.items()) or "nothing to clear")
        return 0
    st = client.cache_stats()
    if args.json:
        return _print_json(st)
    r, p = st["responses"], st["prefixes"]
    if r.get("enabled") is False:
        print("response cache: off")
    else:
        print(f"response cache: {r['entries']} replies, {_mib(r['bytes'])} of {_mib(r['max_bytes'])}; "
              f"hits {r['hits']}, misses {r['misses']}, bypassed {r['bypasses']} since start")
    print(f"prefix cache: {p['entries']} entries, {_mib(p['bytes'])} of {_mib(p['max_bytes'])}; "
          f"entries reused {p['entry_hits']} times")
    for name, e in (p.get("engines") or {}).items():
        if e:
            print(f"  {name}: {e['hits']} hits, {e['misses']} misses, {e['tokens_restored']} tokens restored, "
                  f"{e['saved']} saved")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import asyncio

    from llmd.bench import render, run_bench

    settings = _settings(args)
    if args.json:
        report = asyncio.run(run_bench(settings.base_url, args.concurrency, args.requests, args.duration, args.mix,
                                       args.max_tokens, args.model))
        return _print_json(report)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn()) as bar:
        task = bar.add_task(f"bench {args.mix}", total=args.requests)
        report = asyncio.run(run_bench(settings.base_url, args.concurrency, args.requests, args.duration, args.mix,
                                       args.max_tokens, args.model,
                                       progress=lambda done, total: bar.update(task, completed=done)))
    print(render(report))
    return 0 if report["errors"] == 0 else 1


def _local_registry(args: argparse.Namespace) -> Any:
    from llmd.models.registry import Registry

    settings = _settings(args)
    settings.paths.ensure()
    registry = Registry(settings.paths.registry_db, settings.paths.models_dir)
    registry.sync_packaged()
    return settings, registry


def cmd_quantize(args: argparse.Namespace) -> int:
    """Runs here (it is file work); the daemon sees the new model in the shared registry."""
    from pathlib import Path

    from rich.progress import BarColumn, Progress, TimeElapsedColumn

    from llmd.models.quantize import plan, quantize

    if args.backend == "tensorrt":
        from llmd.backends.tensorrt.engine import CALIB_FILE

        print("TensorRT models are quantized when the engine is built, calibrated on the prompts in "
              f"{args.calib or CALIB_FILE}; start the daemon with LLMD_BACKEND=tensorrt on a GPU machine.")
        return 0
    if args.imatrix:
        print("llmd: --imatrix is not supported yet: llama-cpp-python cannot pass an importance matrix to "
              "llama_model_quantize; use llama.cpp's llama-quantize --imatrix and `llmd models add`", file=sys.stderr)
        return 1
    settings, registry = _local_registry(args)
    src = registry.get(args.model)
    qtype = args.type.upper()
    name = args.name or f"{args.model}-{qtype.lower()}"
    registry.check_free(name)
    p = plan(Path(src["path"]), settings.paths.models_dir / f"{name}.gguf", qtype)
    if p.warning:
        print(f"warning: {p.warning}", file=sys.stderr)
    with Progress("[progress.description]{task.description}", BarColumn(), "{task.percentage:>3.0f}%",
                  TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task(f"{args.model} -> {qtype}", total=1.0)
        out = quantize(p, progress=lambda f: bar.update(task, completed=f))
    row = registry.add(out, name, source="created", parent=args.model, quant_type=qtype)
    print(f"created {name}: {row['quantization']}, {_mib(row['size'])} (from {args.model}, {_mib(src['size'])})")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from llmd.models.evaluate import evaluate, load_text

    settings, registry = _local_registry(args)
    model = registry.get(args.model)
    base = registry.get(args.base) if args.base else None
    text = load_text(Path(args.text)) if args.text else None
    from llmd.backends.repack import RepackRecord, decide_for_files

    paths = [model["path"], *([base["path"]] if base else [])]
    repack = decide_for_files(settings.repack, RepackRecord(settings.paths.repack_record), paths, args.model)
    if not repack.repack:
        print(f"note: {repack.reason}", file=sys.stderr)
    result = evaluate(model["path"], base["path"] if base else None, text, tokens=args.tokens, window=args.window,
                      repack=repack.repack)
    out = {**result.as_dict(), "base": args.base, "text": args.text or "built-in"}
    registry.set_eval(args.model, out)
    if args.json:
        return _print_json(out)
    print(f"{args.model}: perplexity {result.perplexity:.3f} over {result.tokens_scored} tokens "
          f"({result.windows} windows of {result.window})")
    if base is not None:
        assert result.kl_mean is not None and result.top1_agreement is not None and result.ppl_ratio is not None
        print(f"against {args.base}: mean KL divergence {result.kl_mean:.5f} (p99 {result.kl_p99:.4f}), "
              f"top-1 agreement {result.top1_agreement:.1%}, perplexity ratio {result.ppl_ratio:.4f}")
        kl_warn = args.kl_warn if args.kl_warn is not None else settings.kl_warn
        if result.kl_mean > kl_warn:
            print(f"warning: KL divergence {result.kl_mean:.4f} is above {kl_warn} (LLMD_KL_WARN / --kl-warn): "
                  "this quantization changes the model's answers noticeably")
    return 0


def cmd_tray(args: argparse.Namespace) -> int:
    from llmd.tray.app import TrayApp

    TrayApp(_settings(args)).run()
    return 0


def cmd_service(args: argparse.Namespace) -> int:
    from llmd import service

    if args.action == "install":
        for path in service.install():
            print(f"installed {path}")
        print("llmd starts at your next login; `llmd service uninstall` undoes this")
    elif args.action == "uninstall":
        removed = service.uninstall()
        for path in removed:
            print(f"removed {path}")
        if not removed:
            print("nothing was installed")
    else:
        print("installed" if service.installed() else "not installed")
    return 0


# ---- generation -------------------------------------------------------------------------------


def _params(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if args.max_tokens:
        params["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        params["temperature"] = args.temperature
    return params


def cmd_run(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    for piece in _client(args).chat_stream(args.name, [{"role": "user", "content": prompt}], **_params(args)):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    client = _client(args)
    client.health()
    messages: list[dict[str, str]] = []
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"Chatting with {args.name}. Empty line or Ctrl-D ends.")
    while True:
        if interactive:
            sys.stdout.write(">>> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line or not line.strip():
            return 0
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = []
        for piece in client.chat_stream(args.name, messages, **_params(args)):
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})


# ---- parser -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmd", description="A local LLM inference daemon built for latency.",
                                epilog="settings (environment):\n" + describe(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"llmd {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def cmd(name: str, fn: Any, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help)
        sp.add_argument("--host", help="daemon address (LLMD_HOST)")
        sp.add_argument("--port", type=int, help="daemon port (LLMD_PORT)")
        sp.set_defaults(fn=fn)
        return sp

    s = cmd("serve", cmd_serve, "run the daemon in the foreground")
    s.add_argument("--model", help="model to load at start (LLMD_MODEL)")
    s.add_argument("--ctx", type=int, help="context per slot, tokens (LLMD_CTX)")
    s.add_argument("--slots", type=int, help="concurrent sequences (LLMD_SLOTS)")
    s.add_argument("--backend", choices=["auto", "llama.cpp", "tensorrt"], help="engine (LLMD_BACKEND)")
    s = cmd("doctor", cmd_doctor, "probe this machine and show which backend llmd picks, and why")
    s.add_argument("--json", action="store_true")
    s = cmd("start", cmd_start, "start the daemon in the background; returns once it answers")
    s.add_argument("--timeout", type=float, default=120.0)
    s = cmd("stop", cmd_stop, "stop the daemon")
    s.add_argument("--timeout", type=float, default=30.0)
    s = cmd("status", cmd_status, "daemon, loaded models, slots, backend and why")
    s.add_argument("--json", action="store_true")
    s.add_argument("--verbose", "-v", action="store_true", help="also per-step engine timing (LLMD_PROFILE=1)")
    s = cmd("ps", cmd_ps, "loaded models")
    s.add_argument("--json", action="store_true")
    s = cmd("models", cmd_models, "list, show, add, remove or pair models (pair TARGET DRAFT: a draft model "
                                  "for speculation)")
    s.add_argument("action", nargs="?", choices=["list", "show", "add", "rm", "pair"])
    s.add_argument("name", nargs="?", help="model name (a .gguf path for add; the target for pair)")
    s.add_argument("draft", nargs="?", help="pair: the draft model (same vocabulary, smaller)")
    s.add_argument("--none", action="store_true", help="pair: unpair the target's draft model")
    s.add_argument("--name", dest="as_name", help="name to register an added model under")
    s.add_argument("--json", action="store_true")
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
    s = cmd("quantize", cmd_quantize, "quantize a registered model into a new one (llama.cpp types)")
    s.add_argument("model")
    s.add_argument("--type", required=True, help="Q4_K_M, Q4_0, Q5_K_M, Q8_0 or F16")
    s.add_argument("--name", help="name of the new model (default MODEL-TYPE)")
    s.add_argument("--imatrix", help="importance matrix file (not supported yet)")
    s.add_argument("--backend", choices=["llama.cpp", "tensorrt"], default="llama.cpp")
    s.add_argument("--calib", help="TensorRT calibration prompts file")
    s = cmd("eval", cmd_eval, "perplexity, and KL divergence / top-1 agreement against a base model")
    s.add_argument("model")
    s.add_argument("--base", help="reference model (e.g. the F16 original)")
    s.add_argument("--text", help="evaluation text file (default: the text shipped with llmd)")
    s.add_argument("--tokens", type=int, default=1024)
    s.add_argument("--window", type=int, default=256)
    s.add_argument("--kl-warn", type=float, default=None, help="default: LLMD_KL_WARN")
    s.add_argument("--json", action="store_true")
    cmd("tray", cmd_tray, "the tray icon (needs a desktop session)")
    s = cmd("service", cmd_service, "start llmd and its tray at login: install, uninstall or status")
    s.add_argument("action", choices=["install", "uninstall", "status"])
    s = cmd("use", cmd_use, "switch the active model (loads it, retires the other)")
    s.add_argument("name")
    for name, fn, help in (("run", cmd_run, "stream one reply (prompt from stdin when omitted)"),
                           ("chat", cmd_chat, "chat interactively")):
        s = cmd(name, fn, help)
        s.add_argument("name", help="model name")
        if name == "run":
            s.add_argument("prompt", nargs="?")
        s.add_argument("--max-tokens", type=int)
        s.add_argument("--temperature", type=float)
    return p


def main(argv: list[str] | None = None) -> int:
    from llmd.client import DaemonError, DaemonNotRunning
    from llmd.errors import LlmdError

    args = build_parser().parse_args(argv)
    if args.command == "bench" and args.requests is None and args.duration is None:
        args.requests = 20
    try:
        return int(args.fn(args))
    except (DaemonNotRunning, DaemonError, LlmdError, ValueError) as e:
        print(f"llmd: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
