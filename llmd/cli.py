"""The `llmd` command. Exit codes: 0 ok, 1 failure, 2 usage."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from llmd import __version__
from llmd.config import describe, load_settings


def _settings(args: argparse.Namespace) -> Any:
    return load_settings({"host": getattr(args, "host", None), "port": getattr(args, "port", None),
                          "model": getattr(args, "model", None)})


def cmd_serve(args: argparse.Namespace) -> int:
    from llmd.daemon.server import serve

    settings = load_settings({"host": args.host, "port": args.port, "model": args.model, "ctx": args.ctx,
                              "slots": args.slots})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(settings)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from llmd.client import Client

    status = Client(_settings(args)).status()
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"llmd {status['version']} at {status['address']}, pid {status['pid']}, up {status['uptime_s']:.0f}s")
    b = status["backend"]
    console.print(f"backend: {b['name']} ({b['precision']}): {b['reason']}")
    console.print(f"active model: {status['active_model']}; requests in flight: {status['requests_in_flight']}")
    table = Table("model", "pid", "slots busy", "waiting", "ctx/slot", "load s")
    for m in status["loaded"]:
        st = m.get("stats") or {}
        table.add_row(m["name"], str(m["pid"]), f"{st.get('slots_busy', '?')}/{st.get('slots', '?')}",
                      str(st.get("waiting", "?")), str(m.get("n_ctx")), str(m.get("load_s")))
    console.print(table)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from llmd.client import Client

    models = Client(_settings(args)).models()
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "params", "quant", "size MB")
    for m in models:
        d = m["details"]
        table.add_row(m["name"], d["parameter_size"], d["quantization_level"], f"{m['size'] / 1e6:.0f}")
    Console().print(table)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from llmd.client import Client

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    params: dict[str, Any] = {}
    if args.max_tokens:
        params["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        params["temperature"] = args.temperature
    for piece in Client(_settings(args)).chat_stream(args.name, [{"role": "user", "content": prompt}], **params):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmd", description="A local LLM inference daemon built for latency.",
                                epilog="settings (environment):\n" + describe(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"llmd {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--host", help="daemon address (LLMD_HOST)")
        sp.add_argument("--port", type=int, help="daemon port (LLMD_PORT)")

    s = sub.add_parser("serve", help="run the daemon in the foreground")
    common(s)
    s.add_argument("--model", help="model to load at start (LLMD_MODEL)")
    s.add_argument("--ctx", type=int, help="context per slot, tokens (LLMD_CTX)")
    s.add_argument("--slots", type=int, help="concurrent sequences (LLMD_SLOTS)")
    s.set_defaults(fn=cmd_serve)

    s = sub.add_parser("status", help="show the daemon, its models and its backend")
    common(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_status)

    s = sub.add_parser("models", help="list registered models")
    common(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_models)

    s = sub.add_parser("run", help="stream one reply to the terminal (prompt from stdin when omitted)")
    common(s)
    s.add_argument("name", help="model name")
    s.add_argument("prompt", nargs="?")
    s.add_argument("--max-tokens", type=int)
    s.add_argument("--temperature", type=float)
    s.set_defaults(fn=cmd_run)
    return p


def main(argv: list[str] | None = None) -> int:
    from llmd.client import DaemonError, DaemonNotRunning
    from llmd.errors import LlmdError

    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except (DaemonNotRunning, DaemonError, LlmdError, ValueError) as e:
        print(f"llmd: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
