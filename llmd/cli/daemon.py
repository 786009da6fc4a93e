"""Daemon commands: serve, start, stop, status, ps, doctor."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

from llmd.cli._common import AddCommand, client_of, mib, print_json, settings_of


def cmd_serve(args: argparse.Namespace) -> int:
    from llmd.daemon.server import serve
    from llmd.logs import setup

    settings = settings_of(args, model=args.model, ctx=args.ctx, slots=args.slots, backend=args.backend)
    setup(settings.paths.log_file)
    logging.getLogger("llmd.server").info("settings", extra={"settings": settings.as_dict()})
    serve(settings)
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    """Start the daemon detached; return once it is healthy, or say why not."""
    from llmd.client import DaemonNotRunning

    settings = settings_of(args)
    client = client_of(args)
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


def _is_llmd(pid: int) -> bool:
    """Whether process `pid` is an llmd daemon (`llmd serve`, `python -m llmd serve`) of this user."""
    import psutil

    try:
        p = psutil.Process(pid)
        cmd = " ".join(p.cmdline())
        same_user = p.uids().real == os.getuid() if hasattr(os, "getuid") else True
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return same_user and "llmd" in cmd and " serve" in f" {cmd}"


def cmd_stop(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    pid_file = settings.paths.pid_file
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        print(f"llmd is not running (no pid file at {pid_file})")
        return 0
    if not _is_llmd(pid):  # a stale file whose pid now belongs to another program: never signal it
        pid_file.unlink(missing_ok=True)
        print(f"llmd was not running (removed a stale pid file; pid {pid} is not llmd)")
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


def _remote_health(registry: Any) -> dict[str, Any]:
    """Each remote model's upstreams, checked now (a few seconds at most each)."""
    import json

    from llmd.backends.remote.upstream import check_now

    out = {}
    for row in registry.list():
        if row["format"] == "remote":
            spec = json.loads(row["remote"])
            out[row["name"]] = {**{k: spec[k] for k in ("upstream_model", "kind", "fallback")},
                                "upstreams": [check_now(u, spec["api_key_env"], spec["api_key_file"])
                                              for u in spec["urls"]]}
    return out


def cmd_doctor(args: argparse.Namespace) -> int:
    """Runs here, without the daemon: the same probe and choice the daemon makes."""
    from llmd.backends.select import choose, formats_of, probe
    from llmd.config import SETTINGS, fixed_ctx
    from llmd.models.registry import Registry

    settings = settings_of(args)
    settings.paths.ensure()
    p = probe()
    registry = Registry(settings.paths.registry_db, settings.paths.models_dir)
    registry.sync_packaged()
    row = registry.get(settings.model)
    override = None if settings.backend == "auto" else settings.backend
    choice = choose(p, formats_of(row, fixed_ctx(settings.ctx), settings.slots), override)
    from llmd.backends.repack import RepackRecord

    record = RepackRecord(settings.paths.repack_record)
    repack = record.decide(settings.repack, (row["quantization"],)) if row["format"] == "gguf" else None
    from llmd.models.importers import find_all

    registered = {r["path"] for r in registry.list()}
    elsewhere = [f for f in find_all() if not f.skip and str(f.path.resolve()) not in registered]
    remote = _remote_health(registry)
    from llmd.config import draft_pairs
    from llmd.models.drafts import choose_draft, vocab_compatible

    draft, draft_why = (choose_draft(row, registry.list(), draft_pairs(settings.draft).get(row["name"]),
                                     settings.auto_draft, vocab_compatible)
                        if choice.backend == "llama.cpp" else (None, f"not used by {choice.backend}"))
    if args.json:
        return print_json({"machine": p.as_dict(), "model": settings.model, "choice": choice.as_dict(),
                           "draft": {"model": draft["name"] if draft else None, "reason": draft_why},
                           "not_imported": [f.as_dict() for f in elsewhere], "remote": remote,
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
    print(f"draft model: {draft['name'] if draft else 'none'} ({draft_why})")
    if choice.backend == "tensorrt":
        from llmd.backends.tensorrt.engine import built_engine, pre_quantized, speculation_notes

        folder = row.get("hf_path") or row["path"]
        on_engine = built_engine(folder) or not pre_quantized(folder)  # else the PyTorch LLM takes speculation
        for note in speculation_notes(settings.speculation, None, "a TensorRT engine") if on_engine else []:
            print(f"  {note}")
    if repack is not None:
        print(f"weight repacking ({record.kind}): {'on' if repack.repack else 'off'} ({repack.reason})")
    for entry in record.here():
        print(f"  recorded {entry.get('when')}: {entry.get('reason')} [{entry.get('file_type')}, "
              f"llama-cpp-python {entry.get('llama_cpp')}]")
    if elsewhere:
        by = {src: sum(f.source == src for f in elsewhere) for src in ("ollama", "lmstudio", "hf")}
        print(f"\nfound {len(elsewhere)} models downloaded by other tools and not registered ("
              + ", ".join(f"{k}: {v}" for k, v in by.items() if v) + "); `llmd models import` registers them "
              "in place, without copying")
    for name, r in remote.items():
        print(f"\nremote model {name}: {r['upstream_model']} ({r['kind']})"
              + (f", fallback {r['fallback']}" if r["fallback"] else ""))
        for u in r["upstreams"]:
            print(f"  {u['url']}: " + (f"up, {u['latency_ms']} ms, serving {', '.join(u['models'][:5])}" if u["up"]
                                       else f"DOWN ({u['last_error']})"))
    print("\nsettings:")
    values = settings.as_dict()
    for s in SETTINGS:
        print(f"  {s.env:<24} {values[s.name]!r}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    status = client_of(args).status()
    if args.json:
        return print_json(status)
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"llmd {status['version']} [green]running[/] at {status['address']}, pid {status['pid']}, "
                  f"up {status['uptime_s']:.0f}s")
    b = status["backend"]
    console.print(f"backend: {b['name']} ({b['precision']}): {b['reason']}")
    console.print(f"active model: {status['active_model']}; requests running or queued: "
                  f"{status['requests_in_flight']} (limit {status['capacity']}); "
                  f"memory available: {mib(status['memory_available'])}")
    console.print(f"speculation for requests that name none: {status.get('speculation', '?')}")
    table = Table("model", "pid", "memory", "slots busy", "queued", "ctx/slot", "step ms", "unloads")
    for m in status["loaded"]:
        st = m.get("stats") or {}
        exp = m.get("expires_at")
        table.add_row(m["name"], str(m["pid"]), mib(m.get("memory_estimate", {}).get("total")),
                      f"{st.get('slots_busy', '?')}/{st.get('slots', '?')}", str(st.get("waiting", "?")),
                      str(m.get("n_ctx")), str(st.get("step_ms_p50")),
                      "never" if exp is None else f"in {max(0, exp - time.time()):.0f}s")
    console.print(table if status["loaded"] else "no model loaded")
    for m in status["loaded"]:
        st = m.get("stats") or {}
        if m.get("engine") == "remote":
            console.print(f"{m['name']}: remote ({m.get('kind')}), upstream model {m.get('upstream_model')}"
                          + (f", fallback {st['fallback']}" if st.get("fallback") else ""))
            for u in st.get("upstreams", []):
                state = "[green]up[/]" if u["up"] else f"[red]down[/] ({u['last_error']})"
                console.print(f"  {u['url']}: {state}, check {u['latency_ms']} ms, {u['in_flight']} in flight, "
                              f"{u['served']} served")
            continue
        spec = st.get("speculation") or {}
        if spec or m.get("draft_reason"):  # the pairing is known without the worker's stats
            console.print(f"{m['name']}: draft model {m.get('draft') or 'none'} ({m.get('draft_reason', '?')}); "
                          "accepted drafts: " + (_acceptance(spec) if spec else "? (the engine is busy)")
                          + "".join(f"; {k} {x:.2f}x plain decoding" for k, x in (spec.get("speedup") or {}).items()))
        if isinstance(m.get("speculation"), dict):  # TensorRT-LLM: fixed when the model loaded
            sp = m["speculation"]
            console.print(f"{m['name']}: speculation {sp['mode']} (fixed at load; LLMD_SPECULATION={sp['asked']}; "
                          "a request's own speculation does not change it on this engine)")
        for note in m.get("notes") or []:
            console.print(f"{m['name']}: {note}")
        if st.get("stale_s"):
            console.print(f"{m['name']}: the engine is inside a long step; its figures here are {st['stale_s']} s old")
        th = st.get("threads")
        if th:
            console.print(f"{m['name']}: threads {th['reason']}")
        if m.get("ctx_reason"):
            console.print(f"{m['name']}: context {m['ctx_reason']}")
        rp = m.get("repack") or {}
        console.print(f"{m['name']}: {m.get('policy', '?')} batching policy; weight repacking "
                      f"{'on' if rp.get('repack') else 'off'} ({rp.get('reason', '?')})")
    apps = status.get("apps") or []
    if apps:
        console.print("apps, last 10 minutes: " + "; ".join(
            f"{a['app']} on {a['model']}: {a['requests']} requests, {a['engine_s']:.1f} s" for a in apps[:8]))
    for name, n in (status.get("dropped_messages") or {}).items():
        console.print(f"{name}: {n} old chat messages left out to fit the context (Ollama's API, as Ollama does)")
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
    loaded = client_of(args).status()["loaded"]
    if args.json:
        return print_json(loaded)
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "pid", "memory", "processor", "context", "until", "why loaded")
    for m in loaded:
        exp = m.get("expires_at")
        gpu = m.get("gpu_layers") or 0
        why = "; ".join(w for w in (m.get("resident"), m.get("draft_copies")) if w)
        table.add_row(m["name"], str(m["pid"]), mib(m.get("memory_estimate", {}).get("total")),
                      "100% CPU" if not gpu else f"{gpu} layers GPU", str(m.get("n_ctx")),
                      "forever" if exp is None else time.strftime("%H:%M:%S", time.localtime(exp)), why)
    Console().print(table)
    return 0


def register(cmd: AddCommand) -> None:
    s = cmd("serve", cmd_serve, "run the daemon in the foreground")
    s.add_argument("--model", help="model to load at start (LLMD_MODEL)")
    s.add_argument("--ctx", help="context per slot, tokens, or auto (LLMD_CTX)")
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
