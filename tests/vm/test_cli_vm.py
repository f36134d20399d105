"""Every gpupin subcommand and the shell (stdin, -c and a pty) against the simulator."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

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


# A process of its own that pins 100,000 bytes 100 bytes into an allocation, so 2 GPU pages;
# a line on stdin frees the memory (an invalidation), the next one unpins, the next ends it.
PINNER = """
import sys
import gpupin
with gpupin.Device() as dev, gpupin.SimMemory() as mem:
    va = mem.alloc(1 << 20)
    pin = dev.pin(va + 100, 100000, user_tag=0x70B)
    print(pin.handle, pin.aligned_size, flush=True)
    for step in ("free", "unpin"):
        sys.stdin.readline()
        mem.free(va) if step == "free" else dev.unpin(pin)
        print(step, flush=True)
    sys.stdin.readline()
"""


def _mine(snap: dict, pid: int) -> list[dict]:  # type: ignore[type-arg]
    return [p for p in snap["processes"] if p["pid"] == pid]


def _step(child: subprocess.Popen[str], what: str) -> None:
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write("\n")
    child.stdin.flush()
    assert child.stdout.readline().strip() == what


def test_top_reports_another_process_pin_until_it_unpins(gpupin_loaded: None, leakcheck: None) -> None:
    from gpupin.tools import top

    child = subprocess.Popen([sys.executable, "-c", PINNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        handle, aligned = map(int, child.stdout.readline().split())
        assert aligned == 2 * 65536  # 100 + 100,000 bytes widened to 64 KiB GPU pages
        comm = open(f"/proc/{child.pid}/comm").read().strip()
        snap = js("top", "--once", "--interval", "0.2")
        assert snap["version"] == 1 and snap["module"]["provider"] == "nvp2p_sim"  # type: ignore[index]
        dmem = open("/sys/module/gpupin/parameters/dmem").read().strip() == "Y"
        assert snap["budget"] == {  # type: ignore[index]
            "mechanism": "dmem cgroup" if dmem else "none",
            "limit_bytes": None,
            "used_bytes": snap["stats"]["bytes_now"],  # type: ignore[index]
            "detail": "no limit in force (max_pinned_bytes=0; max_file_pinned_bytes=0, no dmem controller)"
            if open("/sys/module/gpupin/parameters/dmem").read().strip() == "N"
            else "each cgroup's dmem.max of gpupin/<pci device>/bar1",
        }
        assert snap["events"] == "subscribed"  # type: ignore[index]
        assert _mine(snap, child.pid) == [  # type: ignore[arg-type]
            {
                "pid": child.pid,
                "comm": comm,
                "pins": 1,
                "detached": 0,
                "invalidated": 0,
                "bar1_bytes": aligned,
                "requested_bytes": 100000,
                "gpus": 1,
                "invalidations_per_s": 0.0,
            }
        ]
        (gpu,) = snap["gpus"]  # type: ignore[index]
        assert gpu["gpu"].startswith("GPU-") and gpu["bar1_bytes"] >= aligned
        # Text, for a 60-column terminal: cut, not wrapped.
        env = {**os.environ, "COLUMNS": "60", "GPUPIN_HISTORY": os.devnull}
        r = subprocess.run(
            [sys.executable, "-m", "gpupin", "top", "--once", "--interval", "0"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120 * SLOW,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        lines = r.stdout.splitlines()
        assert lines[0].startswith("gpupin top") and max(map(len, lines)) <= 60, r.stdout
        assert any(line.split()[:3] == [str(child.pid), comm[:16], "1"] for line in lines if line.strip()), r.stdout
        # The memory freed within the window: an invalidation, by this owner, and no BAR1 left.
        timer = threading.Timer(0.5, _step, (child, "free"))
        timer.start()
        view = top.run_once(3.0)
        timer.join()
        (row,) = [p for p in view.processes if p.pid == child.pid]
        assert (row.invalidated, row.bar1_bytes) == (1, 0)
        assert row.invalidations_per_s and row.invalidations_per_s > 0
        assert view.rates.invalidations_per_s and view.rates.invalidations_per_s > 0
        _step(child, "unpin")
        snap = js("top", "--once", "--interval", "0")
        assert _mine(snap, child.pid) == [] and snap["interval_s"] is None  # type: ignore[arg-type, index]
    finally:
        child.kill()
        child.wait()


def _top_on_a_pty(keys: bytes) -> tuple[bytes, int]:
    """``gpupin top`` on a 30x100 pseudo-terminal under bash, which then prints its exit
    status and the terminal's settings: what the terminal showed, and top's status."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    script = f"trap : INT; {sys.executable} -m gpupin top --interval 0.5; echo top-rc=$?; stty -a; echo top-end"
    pid, fd = pty.fork()
    if pid == 0:
        try:
            os.environ.update(TERM="xterm", GPUPIN_HISTORY=os.devnull)
            os.execvp("bash", ["bash", "-c", script])
        finally:
            os._exit(127)  # public, despite the underscore: exit without cleanup
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    out, shown = b"", 0.0
    deadline = time.monotonic() + 120 * SLOW
    while b"top-end" not in out and time.monotonic() < deadline:
        if not shown and b"BAR1" in out:
            shown = time.monotonic()
        if shown and time.monotonic() > shown + 1.5:  # after a redraw or two
            os.write(fd, keys)
            shown = float("inf")
        if select.select([fd], [], [], 0.5)[0]:
            try:
                out += os.read(fd, 65536)
            except OSError:
                break
    os.waitpid(pid, 0)
    os.close(fd)
    m = re.search(rb"top-rc=(\d+)", out)
    assert m and b"top-end" in out, out[-3000:]
    return out, int(m.group(1))


@pytest.mark.parametrize("keys", [b"q", b"\x03"], ids=["q", "ctrl-c"])
def test_top_on_a_terminal_quits_and_restores_it(gpupin_loaded: None, keys: bytes) -> None:
    out, rc = _top_on_a_pty(keys)
    assert rc == 0, out[-3000:]
    assert b"gpupin top" in out and b"budget: none" in out
    settings = out[out.index(b"top-rc=") :]
    # The line discipline as it was: canonical input and echo back on, the cursor shown.
    assert re.search(rb"(?<!-)icanon", settings) and re.search(rb"(?<![-\w])echo\b", settings), settings
    assert b"Traceback" not in out, out[-3000:]
