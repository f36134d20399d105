"""The driver developer's path, driven through a pseudo-terminal as a person
at a terminal would: ``scripts/vm-run.sh shell`` boots the VM with the
modules loaded, the guest shell has job control and echo, Ctrl-C interrupts
a guest command (not the VM), ``gpupin shell`` shows its prompt, runs
commands and completes on Tab, Ctrl-D leaves it, and ``exit`` ends the VM
with a clean kernel log.

Boots a VM (minutes under software emulation): run by ``make test-vm``.
"""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BOOT_TIMEOUT = 600.0
STEP_TIMEOUT = 180.0


class Terminal:
    """A child process on the slave side of a pty; what it prints is kept."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.master, slave = pty.openpty()
        # A 30x100 terminal: vm-run.sh passes the size on to the guest's pty.
        import fcntl
        import struct
        import termios

        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        self.proc = subprocess.Popen(
            argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            cwd=ROOT,
            start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        )
        os.close(slave)
        self.out = b""
        self.seen = b""

    def expect(self, pattern: str, timeout: float = STEP_TIMEOUT) -> re.Match[bytes]:
        """Wait for ``pattern`` in what came since the last match; consume up to it."""
        rx = re.compile(pattern.encode())
        deadline = time.monotonic() + timeout
        while True:
            m = rx.search(self.out)
            if m:
                self.seen = self.out[: m.end()]  # what this expect consumed, the match included
                self.out = self.out[m.end() :]
                return m
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"no {pattern!r} within {timeout:.0f} s; the terminal shows:\n"
                    + self.out[-3000:].decode(errors="replace")
                )
            r, _, _ = select.select([self.master], [], [], min(left, 1.0))
            if r:
                try:
                    data = os.read(self.master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    data = b""
                if not data and self.proc.poll() is not None:
                    raise AssertionError(
                        f"the VM ended (status {self.proc.returncode}) before {pattern!r}:\n"
                        + self.out[-3000:].decode(errors="replace")
                    )
                self.out += data

    def send(self, data: str) -> None:
        os.write(self.master, data.encode())

    def close(self) -> int:
        try:
            self.proc.wait(timeout=STEP_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        # Drain what is left (the harness's verdict on the kernel log).
        while select.select([self.master], [], [], 0.2)[0]:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                break
            if not data:
                break
            self.out += data
        os.close(self.master)
        return self.proc.returncode


@pytest.mark.timeout(1800)
def test_vm_shell_in_a_terminal(tmp_path: Path) -> None:
    env = dict(os.environ, RESULTS=str(tmp_path / "results"), TERM="xterm")
    term = Terminal([str(ROOT / "scripts" / "vm-run.sh"), "shell"], env)
    try:
        term.expect(r"loaded\s+\['nvp2p_sim', 'gpupin_cb', 'gpupin'\]", BOOT_TIMEOUT)
        term.expect(r"# $")
        # Echo and a real terminal with the host's size, job control on.
        term.send("tty; stty size; set -o | grep -w monitor\r")
        term.expect(r"/dev/pts/\d+")
        term.expect(r"30 100")
        term.expect(r"monitor\s+on")
        term.expect(r"# $")
        # Ctrl-C interrupts the guest's foreground job; the VM and shell go on.
        term.send("sleep 300; echo after-sleep-$?\r")
        term.expect(r"after-sleep-\$\?")  # the echo of the typed line
        time.sleep(2)
        term.send("\x03")
        term.expect(r"# $")
        # Interrupted, the rest of the line must not have run: look in what came before the
        # prompt (the expect consumed it; term.out holds only what came after).
        assert not re.search(rb"after-sleep-\d", term.seen), term.seen
        term.send("echo still-$((40+2))\r")
        term.expect(r"still-42")
        # gpupin's shell: prompt, a command, Tab completion, Ctrl-D to leave.
        term.send("gpupin shell\r")
        term.expect(r"gpupin> ")
        term.send("status\r")
        term.expect(r"provider\s+nvp2p_sim")
        term.expect(r"gpupin> ")
        term.send("dma-u\t")
        term.expect(r"dma-unmap ")
        term.send("\x15")  # Ctrl-U: drop the completed line
        term.send("pin --help\r")
        term.expect(r"usage: .*pin")
        term.expect(r"gpupin> ")
        term.send("\x04")
        term.expect(r"# $")
        term.send("exit\r")
        rc = term.close()
    finally:
        if term.proc.poll() is None:
            os.killpg(term.proc.pid, signal.SIGKILL)
    assert rc == 0, term.out[-3000:].decode(errors="replace")
    assert b"kernel log clean" in term.out, term.out[-3000:].decode(errors="replace")
