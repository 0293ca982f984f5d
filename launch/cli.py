"""The installed ``spreeze`` command: ``spreeze train|play|plot|bench ...``.

One entry point with subcommands, as users of other RL toolkits expect; each subcommand hands its arguments
unchanged to the module that owns them (``train`` is ``python run.py``), so the two ways in cannot differ."""
from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path

PROG = "spreeze"


def _train(argv: list[str]) -> int:
    from launch.compose import main

    return main(argv, prog=f"{PROG} train")


def _play(argv: list[str]) -> int:
    from viz.play import main

    return main(argv, prog=f"{PROG} play")


def _plot(argv: list[str]) -> int:
    from viz.plot import main

    return main(argv, prog=f"{PROG} plot")


def _bench(argv: list[str]) -> int:
    names = benchmarks()
    if not argv or argv[0] in ("-h", "--help"):
        print(_bench_help(names), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in names:
        return _unknown(f"{PROG} bench", "benchmark", name, names)
    module = importlib.import_module(f"benchmarks.{name}")
    # the benchmarks' parsers name themselves after argv[0] where they set no prog of their own
    saved, sys.argv[0] = sys.argv[0], f"{PROG} bench {name}"
    try:
        code = module.main(rest)
    finally:
        sys.argv[0] = saved
    return 0 if code is None else int(code)


COMMANDS = {
    "train": ("train an agent; the flags of `python run.py` (spreeze train --help lists them by section)", _train),
    "play": ("replay a run's policy in a window or as a GIF", _play),
    "plot": ("plot the test returns of one or more runs into one PNG", _plot),
    "bench": ("run a benchmark: spreeze bench NAME [args] (spreeze bench --help lists them)", _bench),
}


def benchmarks() -> dict[str, str]:
    """The benchmark modules (those with a ``main``) and the first line of their docstrings.

    Read from the sources, not imported: listing them must not load torch or stable-baselines3."""
    import benchmarks as package

    found = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        spec = importlib.util.find_spec(f"benchmarks.{info.name}")
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
        if any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            found[info.name] = ((ast.get_docstring(tree) or "").strip().splitlines() or [""])[0]
    return found


def _bench_help(names: dict[str, str]) -> str:
    width = max(map(len, names), default=0)
    lines = [f"usage: {PROG} bench NAME [args]   ({PROG} bench NAME --help for its arguments)", "",
             "benchmarks:"]
    lines += [f"  {name:<{width}}  {doc}" for name, doc in names.items()]
    return "\n".join(lines)


def _help() -> str:
    from spreeze import __version__

    width = max(map(len, COMMANDS))
    lines = [f"usage: {PROG} <command> [args]", "",
             f"spreeze {__version__}: high-throughput off-policy RL (SAC, TD3, CrossQ) on one machine", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (text, _) in COMMANDS.items()]
    lines += ["", f"benchmarks ({PROG} bench NAME): " + ", ".join(benchmarks()), "",
              "options:", "  -h, --help     show this help and exit", "  -V, --version  print the version and exit"]
    return "\n".join(lines)


def _unknown(prog: str, what: str, name: str, known) -> int:
    """One line naming the closest known name (a typo is the usual cause), exit code 2."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'?" if close else f"choose from {', '.join(known)}"
    print(f"{prog}: error: unknown {what} '{name}'; {hint}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(_help(), file=sys.stderr)
        return 2
    first, rest = argv[0], argv[1:]
    if first == "help" and rest and rest[0] in COMMANDS:  # `spreeze help train` is `spreeze train --help`
        first, rest = rest[0], ["--help"]
    elif first in ("-h", "--help", "help"):
        print(_help())
        return 0
    if first in ("-V", "--version"):
        from spreeze import __version__

        print(f"{PROG} {__version__}")
        return 0
    if first.startswith("-"):
        print(f"{PROG}: error: {first} is not a command; flags follow the command, e.g. {PROG} train {first} ...",
              file=sys.stderr)
        return 2
    if first not in COMMANDS:
        return _unknown(PROG, "command", first, COMMANDS)
    try:
        return COMMANDS[first][1](rest)
    except SystemExit as done:  # argparse's --help and errors: the code as a return value, for callers and tests
        if isinstance(done.code, str):
            print(done.code, file=sys.stderr)
            return 1
        return done.code or 0
    except KeyboardInterrupt:  # Ctrl-C outside a run (which handles it itself): no traceback
        return 130


if __name__ == "__main__":
    sys.exit(main())
