"""The ``ds-mtraining`` command: a dispatcher from subcommands to modules' ``main(argv)``.

To add a subcommand, add one line to COMMANDS: its module must define ``main(argv) -> int | None``
that parses ``argv`` (the arguments after the subcommand) itself.
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "report": ("ds_mtraining.report", "which sparse attention ops are prebuilt, JIT-compilable "
                                      "or incompatible, and why"),
    "balance": ("ds_mtraining.bench.balance", "striped vs zigzag ring work imbalance from the "
                                              "sparse index (and kernel times on a GPU)"),
    "demo": ("ds_mtraining.demo", "estimate a pattern and run sparse attention on one device"),
    "bench-kernel": ("ds_mtraining.bench.kernel", "sparse kernel vs FlexAttention and dense flash "
                                                  "(GPU)"),
    "bench-comm": ("ds_mtraining.bench.comm", "flat vs hierarchical ring cost model"),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: ds-mtraining <command> [args]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "ds-mtraining <command> --help shows a command's arguments."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"ds-mtraining: unknown command '{name}'\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
