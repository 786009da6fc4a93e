"""Desktop commands: the tray icon, and starting llmd at login."""

from __future__ import annotations

import argparse

from llmd.cli._common import AddCommand, settings_of


def cmd_tray(args: argparse.Namespace) -> int:
    from llmd.tray.app import TrayApp

    TrayApp(settings_of(args)).run()
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


def register(cmd: AddCommand) -> None:
    cmd("tray", cmd_tray, "the tray icon (needs a desktop session)")
    s = cmd("service", cmd_service, "start llmd and its tray at login: install, uninstall or status")
    s.add_argument("action", choices=["install", "uninstall", "status"])
