"""Every gpupin subcommand and the shell (stdin, -c and a pty) against the simulator."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import SLOW, first_pci_device
from gpupin.testing import ShellOnPty

pytestmark = [
    pytest.mark.vm,
    pytest.mark.simonly(
        reason=(
            "drives the CLI's simulator commands (sim alloc, pin --sim-alloc, sim set): the CLI allocates no CUDA"
            " memory"
        )
    ),
]


def gp(*args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUPIN_HISTORY": os.devnull}
    r = subprocess.run(
        [sys.executable, "-m", "gpupin", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=120 * SLOW,
    )
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def js(*args: str) -> object:
    return json.loads(gp(*args, "--json").stdout)


def test_status_and_load(gpupin_loaded: None, leakcheck: None) -> None:
    st = js("status")
    assert st["gpupin"] == "live" and st["nvp2p_sim"] == "live" and st["provider"] == "nvp2p_sim"
    assert st["abi"] == 2 and st["persistent"] is True
    assert js("load")["loaded"] == []  # already loaded: nothing to do
    table = gp("status").stdout
    assert "provider" in table and "nvp2p_sim" in table


def test_one_shot_pin_and_doctor(gpupin_loaded: None, leakcheck: None) -> None:
    row = js("pin", "--sim-alloc", "1M", "--tag", "9")
    assert row["entries"] == 16 and row["valid"] is True and row["tag"] == 9
    checks = js("doctor", "--quick")  # NIXL's selftest takes ~40 s under TCG; the host suite runs it
    assert {c["name"]: c["status"] for c in checks}["gpupin"] == "pass"
    assert js("stats")["pins"] >= 1
    r = gp("query", "12345", check=False)
    assert r.returncode == 1 and "UNPIN" not in r.stdout and "QUERY(handle=12345) failed" in r.stdout


SCRIPT = """
sim alloc 2M
sim write $va hello
sim read $va 5 --json
sim query $va --json
pin $va 2M --tag 7
query $handle --json
pages $handle --count 2
dma-map $handle {pci} --json
ls
ls --all --json
dma-unmap $handle $mapping
sim free $va
watch --timeout 2 --json
query $handle
unpin $handle
sim stats --json
unpin 999
"""


def test_shell_script_on_stdin(gpupin_loaded: None, leakcheck: None) -> None:
    r = gp("shell", stdin=SCRIPT.format(pci=first_pci_device()), check=False)
    out = r.stdout
    assert r.returncode == 1, out  # the last command fails, the rest ran
    assert '"text": "hello"' in out
    assert '"base": "0x' in out and '"buffer_id": ' in out  # sim query: the address in hex
    assert '"state": "pinned"' in out and '"user_tag": 7' in out
    assert "physical_address" in out
    assert '"entries": 32' in out  # dma-map of 2 MiB
    assert '"reason": "freed"' in out  # watch saw the invalidation
    assert "invalidated" in out
    assert "UNPIN(handle=999) failed" in out
    assert out.count("error:") == 1


def test_shell_minus_c_and_watch_in_background(gpupin_loaded: None, leakcheck: None) -> None:
    r = gp("shell", "-c", "watch --background; pin --sim-alloc 64K --tag 3; sim free $va; query $handle")
    # Either the background watcher or nobody consumed the record; the watcher must have printed it
    # before the shell exits, because close() stops and joins it after its last poll.
    assert "[watch] pin 1 (tag 3) invalidated: freed" in r.stdout, r.stdout
    assert "invalidated" in r.stdout and r.stderr == ""


def test_sim_set_and_unknown_commands(gpupin_loaded: None, leakcheck: None, sim_params) -> None:  # type: ignore[no-untyped-def]
    sim_params(pin_latency_us=0)
    r = gp("shell", "-c", "sim set pin_latency_us 5; sim set nosuch 1; frob", check=False)
    assert "pin_latency_us" in r.stdout and "nosuch" in r.stdout and "invalid choice" in r.stdout
    assert open("/sys/module/nvp2p_sim/parameters/pin_latency_us").read().strip() == "5"


def test_shell_on_a_pty_with_completion(gpupin_loaded: None, leakcheck: None, tmp_path) -> None:  # type: ignore[no-untyped-def]
    sh = ShellOnPty(str(tmp_path / "hist"), timeout=30 * SLOW)
    try:
        sh.read_until(b"gpupin> ")
        sh.write(b"statu\t\r")  # tab completes "status"
        out = sh.read_until(b"gpupin> ")
        assert b"provider" in out and b"nvp2p_sim" in out
        sh.write(b"pin --sim-alloc 128K\r")
        assert b"entries" in sh.read_until(b"gpupin> ")
        sh.write(b"query 77\r")
        assert b"error:" in sh.read_until(b"gpupin> ")  # and the shell goes on
        sh.write(b"exit\r")
    finally:
        status = sh.close()
    assert status == 0
    assert "status" in (tmp_path / "hist").read_text()


def test_shell_pins_through_a_dmabuf(gpupin_loaded: None, leakcheck: None) -> None:
    r = gp(
        "shell",
        "-c",
        "sim alloc 1M; pin $va 8K --dmabuf --tag 5 --json; query $handle --json; "
        "sim free $va; query $handle --json; unpin $handle",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert '"dmabuf": true' in r.stdout and '"entries": 2' in r.stdout
    # NVIDIA's exporter (the simulator's default) holds the memory: the free invalidates nothing.
    assert r.stdout.count('"state": "pinned"') == 2 and '"state": "invalidated"' not in r.stdout
    assert '"revocable": false' in r.stdout
