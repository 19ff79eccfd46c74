"""`overnight <command>`: each command lives in its own module, imported only when it runs, so the
engine and `overnight bench` work without the server packages installed."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from overnight import logs
from overnight.errors import USER_ERRORS

# command -> module exposing add_parser(subparsers) and run(args) -> int
COMMANDS = {
    "generate": "overnight.entrypoints.generate_cli",
    "run-batch": "overnight.batch.cli",
    "serve": "overnight.server.cli",
    "bench": "overnight.bench.cli",
    "budget": "overnight.tools.budget",
    "check": "overnight.tools.check",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="overnight", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = argv[0] if argv and argv[0] in COMMANDS else None
    modules = {}
    for name, module_name in COMMANDS.items():
        if wanted is not None and name != wanted:
            sub.add_parser(name)
            continue
        try:
            modules[name] = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if wanted is not None:
                print(
                    f"overnight {name}: needs a package that is not installed ({e.name}); "
                    "install the extra: pip install 'overnight[server]'",
                    file=sys.stderr,
                )
                return 2
            sub.add_parser(name, help="(unavailable: missing packages)")
            continue
        modules[name].add_parser(sub)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    logs.configure(logging.INFO)
    try:
        return int(modules[args.command].run(args) or 0)
    except USER_ERRORS as e:
        # A missing model, an impossible option, a server that is down: one line that says what to
        # change, not a traceback (logging has already said what was done before it).
        print(f"overnight {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
