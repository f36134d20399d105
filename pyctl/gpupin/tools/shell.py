"""``gpupin shell``: an interactive debugging shell for driver developers.

readline history and tab completion, ``help`` per command, tables by default
(``--json`` on any command), and the same commands as the ``gpupin`` command.
Scripts come from stdin or ``-c "cmd; cmd"``; an error prints and the shell
goes on.  The shell's device, simulator context and pins persist until exit.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path

from .cli import Session, build_parser, run_command

HISTORY = Path(os.environ.get("GPUPIN_HISTORY", str(Path.home() / ".gpupin_history")))


def take_ctrl_c() -> None:
    """Make Ctrl-C at the prompt drop the line, whatever this process inherited.

    A job started with '&' by a non-interactive shell (a CI runner, a scheduler, a test
    harness) inherits SIGINT ignored, and exec keeps that, as it keeps a blocked signal mask:
    Python then never installs its KeyboardInterrupt handler and Ctrl-C does nothing at all.
    An interactive shell on a terminal takes the signal back."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class Shell:
    prompt = "gpupin> "

    def __init__(self) -> None:
        self.session = Session()
        self.session.out = lambda text: print(text, flush=True)
        self.parser = build_parser()
        # argparse has no public way to list subcommands or a subcommand's options: here and in
        # _complete its internals (_subparsers, _group_actions, _actions) are read.
        self.commands = sorted(
            name
            for name in self.parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
            if name != "shell"
        )
        self.status = 0

    def help(self, args: list[str]) -> None:
        if args:
            run_command(self.session, [args[0], "--help"], self.parser)
            return
        print("commands: " + " ".join(self.commands + ["help", "exit"]))
        print("'help COMMAND' for its arguments; every command takes --json")

    def one(self, line: str) -> bool:
        """Run one line; False when the shell should stop."""
        line = line.strip()
        if not line or line.startswith("#"):
            return True
        try:
            argv = shlex.split(line)
        except ValueError as exc:
            print(f"error: {exc}", flush=True)
            self.status = 1
            return True
        if argv[0] in ("exit", "quit"):
            return False
        if argv[0] in ("help", "?"):
            self.help(argv[1:])
            return True
        if run_command(self.session, argv, self.parser):
            self.status = 1
        return True

    def _complete(self, text: str, state: int) -> str | None:
        import readline

        buf = readline.get_line_buffer()
        words = buf.split()
        if len(words) <= 1 and not buf.endswith(" "):
            options = [c + " " for c in self.commands + ["help", "exit"] if c.startswith(text)]
        else:
            sp = self.parser._subparsers._group_actions[0].choices.get(words[0])  # type: ignore[union-attr]
            flags = [o for act in (sp._actions if sp else []) for o in act.option_strings]
            choices = [c for act in (sp._actions if sp else []) for c in (act.choices or []) if isinstance(c, str)]
            options = [o + " " for o in flags + choices if o.startswith(text)]
        return options[state] if state < len(options) else None

    def run(self, commands: str | None = None) -> int:
        try:
            if commands is not None:
                for part in commands.split(";"):
                    if not self.one(part):
                        break
                return self.status
            if not sys.stdin.isatty():
                for line in sys.stdin:
                    if not self.one(line):
                        break
                return self.status
            return self._interactive()
        finally:
            self.session.close()

    def _interactive(self) -> int:
        import readline

        take_ctrl_c()
        try:
            readline.read_history_file(HISTORY)
        except OSError:
            pass
        readline.set_completer(self._complete)
        readline.set_completer_delims(" ")
        readline.parse_and_bind("tab: complete")
        print("gpupin debugging shell: 'help' lists commands, 'exit' or Ctrl-D leaves.")
        try:
            while True:
                try:
                    line = input(self.prompt)
                except EOFError:
                    print()
                    break
                except KeyboardInterrupt:
                    print("^C")
                    continue
                if not self.one(line):
                    break
        finally:
            try:
                readline.write_history_file(HISTORY)
            except OSError:
                pass
        return 0
