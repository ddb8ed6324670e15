"""`ember` command line: one subcommand per tool, each owned by its package."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with add_arguments(parser) and run(args) -> int, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("ember.engine.generate_cli", "generate text offline from prompts"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ember", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sub)
        modules[name] = module
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
