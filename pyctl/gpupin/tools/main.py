"""``gpupin`` (and ``python -m gpupin``, through gpupin/__main__.py): one command, or the shell.

The entry point sits above both ``cli`` (commands, parser, output) and
``shell`` (which runs cli's commands interactively), so neither imports the
other's caller: shell depends on cli, cli on neither.
"""

from __future__ import annotations

import sys

from . import cli
from .shell import Shell


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = cli.build_parser()
    if argv and argv[0] == "shell":
        try:
            a = parser.parse_args(argv)
        except (cli.UsageError, cli.HelpShown) as exc:
            print(exc, file=sys.stderr)
            return 2
        return Shell().run(a.commands)
    if not argv:
        parser.print_help()
        return 2
    s = cli.Session()
    s.out = lambda text: print(text, flush=True)
    try:
        rc = cli.run_command(s, argv, parser)
    finally:
        s.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
