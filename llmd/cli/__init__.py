"""The `llmd` command. Exit codes: 0 ok, 1 failure, 2 usage (argparse).

Each command group registers its own subcommands: `daemon` (serve, start, stop, status, ps,
doctor), `models` (models list|show|add|rm|pair, use, quantize, eval), `caches` (cache, bench),
`chat` (run, chat) and `desktop` (tray, service).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from llmd import __version__
from llmd.cli import caches, chat, daemon, desktop, models
from llmd.cli._common import address_flags
from llmd.config import describe

GROUPS = (daemon, models, caches, chat, desktop)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmd", description="A local LLM inference daemon built for latency.",
                                epilog="settings (environment):\n" + describe(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"llmd {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def cmd(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help)
        address_flags(sp)
        sp.set_defaults(fn=fn)
        return sp

    for group in GROUPS:
        group.register(cmd)
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

