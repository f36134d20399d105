"""The gpupin command and shell on a host without the module: parsing, output, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpupin.device import parse_pci
from gpupin.errors import InvalidArgument
from gpupin.testing import ShellOnPty
from gpupin.tools import cli


@pytest.mark.parametrize(
    "text,value",
    [("4096", 4096), ("64K", 65536), ("1M", 1 << 20), ("2GiB", 2 << 30), ("0x10000", 65536), ("1mb", 1 << 20)],
)
def test_parse_size(text: str, value: int) -> None:
    assert cli.parse_size(text) == value


@pytest.mark.parametrize("text", ["lots", "-1", "1T"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(Exception, match="size|not a size"):
        cli.parse_size(text)


def test_parse_pci() -> None:
    assert parse_pci("0000:00:03.0") == (0, 0, 0x18)
    assert parse_pci("3b:00.1") == (0, 0x3B, 1)
    for bad in ("00:03", "0000:00:20.0", "zz:00.0", "0:0:0:0.0"):
        with pytest.raises(InvalidArgument, match="PCI address"):
            parse_pci(bad)


def test_table_and_json_output() -> None:
    lines: list[str] = []
    cli.render([{"handle": 1, "va": "0x10"}, {"handle": 22, "va": "0x2000"}], False, lines.append)
    rows = lines[0].splitlines()
    assert rows[0].split() == ["handle", "va"] and rows[2].split() == ["1", "0x10"]
    assert rows[3].split() == ["22", "0x2000"]
    lines.clear()
    cli.render({"a": 1}, True, lines.append)
    assert json.loads(lines[0]) == {"a": 1}


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUPIN_HISTORY": os.devnull}
    return subprocess.run(
        [sys.executable, "-m", "gpupin", *args], input=stdin, capture_output=True, text=True, env=env, timeout=60
    )


def test_usage_errors_exit_nonzero() -> None:
    r = run("pin", "notanumber", "4K")
    assert r.returncode == 1 and "is not a number" in r.stdout
    r = run("frobnicate")
    assert r.returncode == 1 and "invalid choice" in r.stdout
    assert run().returncode == 2


def test_help_per_command() -> None:
    r = run("pin", "--help")
    assert r.returncode == 0 and "--persistent" in r.stdout


@pytest.mark.skipif(os.path.exists("/dev/gpupin"), reason="this host has gpupin loaded")
def test_without_module_says_how_to_load() -> None:
    r = run("query", "1")
    assert r.returncode == 1 and "gpupin load" in r.stdout
    r = run("status", "--json")
    assert r.returncode == 0 and "gpupin load" in json.loads(r.stdout)["device"]


def test_shell_keeps_going_after_errors() -> None:
    r = run("shell", "-c", "help; pin; sim alloc; bogus; help query")
    assert r.returncode == 1  # an error happened, the shell ran every command
    out = r.stdout
    assert "commands:" in out and "give VA and SIZE" in out and "sim alloc takes SIZE" in out
    assert "invalid choice" in out and "usage: gpupin query" in out


def test_shell_reads_a_script_from_stdin() -> None:
    r = run("shell", stdin="# comment\nhelp\n\nexit\nbogus\n")
    assert r.returncode == 0 and "commands:" in r.stdout and "invalid choice" not in r.stdout


def test_doctor_runs_anywhere() -> None:
    r = run("doctor", "--json")
    assert r.returncode == 0
    checks = json.loads(r.stdout)
    names = {c["name"] for c in checks}
    assert {"IOMMU", "ACS", "PCIe path", "gpupin", "BAR1"} <= names
    assert all(c["status"] in ("pass", "warn", "fail", "info") for c in checks)
    assert {"GDS nvidia-fs", "cufile.json", "P2PDMA", "GDS files", "stream memops", "NIXL"} <= names
    quick = json.loads(run("doctor", "--quick", "--json").stdout)
    assert [c for c in quick if c["name"].startswith("NIXL")] == [
        {"status": "info", "name": "NIXL", "detail": "not checked (--quick)", "fix": ""}
    ]
    assert {c["name"] for c in quick} == (names - {n for n in names if n.startswith("NIXL")}) | {"NIXL"}


def test_gds_status_without_cufile_says_what_is_missing() -> None:
    r = run("gds", "status", "--json")
    assert r.returncode == 0
    st = json.loads(r.stdout)
    if "cufile" in st:  # no cuda-python or libcufile on this host
        assert "not usable" in st["cufile"] and ("nvidia-cufile" in st["cufile"] or "cuFile" in st["cufile"])
    else:
        assert st["max_device_pinned_mem_bytes"] > 0
    assert st["GDS nvidia-fs"].split(":")[0] in ("pass", "info")


def test_shell_on_a_terminal(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The interactive shell as a developer meets it on a host without the module: the
    banner, tab completion of commands and of a command's options, an error that does not
    end it, Ctrl-C (a new prompt), Ctrl-D (leaves, exit status 0) and the history file."""
    hist = tmp_path / "hist"
    sh = ShellOnPty(str(hist))
    try:
        assert b"'help' lists commands" in sh.read_until(b"gpupin> ")
        sh.write(b"hel\t\r")  # completes to "help "
        out = sh.read_until(b"gpupin> ")
        assert b"help " in out and b"commands:" in out and b"status" in out
        sh.write(b"query --js\t1\r")  # an option of the command completes
        out = sh.read_until(b"gpupin> ")
        assert b"query --json 1" in out and b"error" in out and b"gpupin load" in out
        sh.write(b"sim \t\t")  # the choices of 'sim' listed, then the line again
        out = sh.read_until(b"gpupin> sim ")
        assert b"alloc" in out and b"free" in out
        sh.interrupt()  # Ctrl-C: the line is dropped, a new prompt
        sh.read_until(b"^C")
        sh.read_until(b"gpupin> ")
        sh.write(b"\x04")  # Ctrl-D leaves
    finally:
        status = sh.close()
    assert status == 0
    assert "query --json 1" in hist.read_text().splitlines()


def test_ctrl_c_reaches_a_shell_started_with_sigint_ignored(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """'make test &' from a non-interactive shell (as CI runners start it) hands every child
    SIGINT ignored; the shell on a terminal must still drop the line on Ctrl-C."""
    sh = ShellOnPty(str(tmp_path / "hist"), sigint_ignored=True)
    try:
        sh.read_until(b"gpupin> ")
        sh.write(b"status --json")
        sh.read_until(b"--json")  # echoed: readline has the line
        sh.interrupt()
        sh.read_until(b"^C")
        sh.read_until(b"gpupin> ")
        sh.write(b"exit\r")
    finally:
        status = sh.close()
    assert status == 0


def test_query_prints_addresses_in_hex_like_ls_and_pin() -> None:
    from gpupin.device import PinState

    st = PinState(7, "pinned", 0x7F0000010000, 4096, 0x7F0000010000, 65536, 3, 1, 0, False, 0)
    row = cli._state_row(st)
    assert (row["va"], row["aligned_va"]) == ("0x7f0000010000", "0x7f0000010000")
    assert row["size"] == 4096 and row["user_tag"] == 3
