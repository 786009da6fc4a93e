"""What every command group shares: settings from the flags, the daemon client, output helpers."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from llmd.config import Settings, load_settings

# cmd(name, fn, help) -> the subparser, with --host and --port (see llmd/cli/__init__.py)
AddCommand = Callable[[str, Callable[[argparse.Namespace], int], str], argparse.ArgumentParser]


def settings_of(args: argparse.Namespace, **extra: Any) -> Settings:
    return load_settings({"host": getattr(args, "host", None), "port": getattr(args, "port", None), **extra})


def client_of(args: argparse.Namespace) -> Any:
    from llmd.client import Client

    return Client(settings_of(args))


def print_json(obj: Any) -> int:
    print(json.dumps(obj, indent=2))
    return 0


def mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 1024 / 1024:.0f} MiB"


def address_flags(p: argparse.ArgumentParser, keep_parent: bool = False) -> None:
    """--host and --port; on a nested subcommand they keep what the parent parsed."""
    kw: dict[str, Any] = {"default": argparse.SUPPRESS} if keep_parent else {}
    p.add_argument("--host", help="daemon address (LLMD_HOST)", **kw)
    p.add_argument("--port", type=int, help="daemon port (LLMD_PORT)", **kw)
