"""`ember` command line: one subcommand per tool, each owned by its package."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with add_arguments(parser) and run(args) -> int, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("ember.bench.cli", "load-test OpenAI-compatible servers side by side"),
    "serve": ("ember.server.cli", "serve a model over the OpenAI-compatible HTTP API"),
    "cost": ("ember.server.cost_cli", "print spend and cached-token savings from the ledger"),
    "route": ("ember.router.cli", "gateway over replicas: session affinity, prefix, health"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="ember", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    # only the chosen subcommand's module is imported: startup stays fast and one tool's
    # dependencies never break another
    chosen = next((a for a in argv if not a.startswith("-")), None)
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            modules[name] = importlib.import_module(module_name)
            modules[name].add_arguments(sub)
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
