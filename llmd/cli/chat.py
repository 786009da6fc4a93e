"""Generation commands: `llmd run` (one reply) and `llmd chat` (interactive)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from llmd.cli._common import AddCommand, client_of


def _params(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if args.max_tokens:
        params["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        params["temperature"] = args.temperature
    return params


def cmd_run(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    for piece in client_of(args).chat_stream(args.name, [{"role": "user", "content": prompt}], **_params(args)):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    client = client_of(args)
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


def register(cmd: AddCommand) -> None:
    for name, fn, help in (("run", cmd_run, "stream one reply (prompt from stdin when omitted)"),
                           ("chat", cmd_chat, "chat interactively")):
        s = cmd(name, fn, help)
        s.add_argument("name", help="model name")
        if name == "run":
            s.add_argument("prompt", nargs="?")
        s.add_argument("--max-tokens", type=int)
        s.add_argument("--temperature", type=float)
