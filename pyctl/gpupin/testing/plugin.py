"""The pytest plugin for gpupin suites (read through ``gpupin.testing``): fixtures and markers.

Fixtures: ``gpupin_loaded`` (modules loaded: the simulator in the VM, or the
real driver with GPUPIN_NATIVE=1), ``device`` (an open Device), ``memory``
(SimMemory, or CudaMemory in native mode), ``sim`` (SimMemory only),
``leakcheck`` (fails a test that leaves simulator pages, BAR bytes,
callbacks or mappings behind) and ``sim_params`` (set simulator/gpupin
parameters for one test, restored afterwards).  ``ShellOnPty`` runs
``gpupin shell`` on a pseudo-terminal for tests of the interactive shell;
``PausedThread`` stops a thread at a chosen call, for tests of interleavings.

Where the modules cannot be loaded the tests skip with the reason, unless
GPUPIN_REQUIRE_VM=1 (set by the VM harness), where that is a failure.

One suite, two providers: a test that needs nothing of the simulator takes
``memory`` and runs in both modes (guard a check of simulator counters inside
it with ``if not NATIVE:``).  A test that does need the simulator (a module
parameter or knob, its counters as the thing checked, its dma-buf exporter,
fault injection, behaviour nvidia.ko has no equivalent for, or a forked child
touching device memory: CUDA contexts do not survive fork) is marked
``@pytest.mark.simonly(reason="...")`` (or ``simonly("...")``) saying which;
in native mode it skips with that reason.  A ``simonly`` without a reason is
warned of at collection and fails tests/host/test_simonly_reasons.py;
``simonly_reason`` reads the reason.
"""

from __future__ import annotations

import contextlib
import os
import pty
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest

from ..device import Device
from ..errors import ModuleError
from ..memory import MemoryProvider
from ..peer import Peer, load_peer
from ..sim import SimMemory, module_param, sim_stats

__all__ = [
    "NATIVE",
    "REQUIRED",
    "PausedThread",
    "ShellOnPty",
    "after_poll",
    "after_read",
    "device",
    "ensure_loaded",
    "gpupin_loaded",
    "in_child",
    "leakcheck",
    "load_peer",
    "memory",
    "peer",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "pytest_runtest_setup",
    "sim",
    "sim_params",
    "simonly_reason",
]

NATIVE = os.environ.get("GPUPIN_NATIVE") == "1"
REQUIRED = os.environ.get("GPUPIN_REQUIRE_VM") == "1"


def ensure_loaded(sim: bool = True, **params: object) -> None:
    """Load nvp2p_sim (if ``sim``) and gpupin unless loaded: from the build tree
    (or GPUPIN_KO_DIR) where the .ko files are, else the installed modules by name."""
    from .. import kmod  # here: a build without the libkmod binding still imports the plugin

    if sim and not kmod.is_loaded("nvp2p_sim"):
        kmod.load(kmod.module_file("nvp2p_sim"))
    if not kmod.is_loaded("gpupin"):
        kmod.load(kmod.module_file("gpupin"), params)


def _unavailable(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"GPUPIN_REQUIRE_VM=1 but {reason}")
    pytest.skip(reason)


def pytest_configure(config: pytest.Config) -> None:
    for line in (
        "vm: needs gpupin.ko and the simulator loaded (runs in the VM)",
        "gpu: needs an NVIDIA GPU with the CUDA driver",
        "native: needs gpupin.ko over a real nvidia.ko",
        "simonly(reason): needs the simulator, reason says why (skipped in native mode)",
    ):
        config.addinivalue_line("markers", line)


def simonly_reason(mark: pytest.Mark) -> str | None:
    """The reason a ``simonly`` mark gives (``reason=`` or its one argument), or None."""
    reason = mark.kwargs.get("reason", mark.args[0] if mark.args else None)
    return reason.strip() or None if isinstance(reason, str) else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Warn of every ``simonly`` without a reason (tests/host/test_simonly_reasons.py fails on them)."""
    for item in items:
        if any(simonly_reason(m) is None for m in item.iter_markers("simonly")):
            item.warn(pytest.PytestWarning("simonly without a reason: write pytest.mark.simonly(reason=...)"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    mark = item.get_closest_marker("simonly")
    if NATIVE and mark is not None:
        why = simonly_reason(mark) or "no reason given"
        pytest.skip(f"simulator only: {why} (this run uses the real nvidia.ko, GPUPIN_NATIVE=1)")


def in_child(fn: Callable[[], int], timeout: float | None = None) -> int:
    """Run fn in a forked child; return its exit status (fn's return value, 99 if it raised,
    -signal if it died of one).  With ``timeout``, a child still running after that many
    seconds (a hang) is killed and pytest fails saying so."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = fn()
        except BaseException as exc:  # report, never return into pytest
            print(f"child failed: {exc!r}", file=sys.stderr)
        finally:
            os._exit(code)  # the os module's public exit without cleanup, despite the underscore
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, 0 if deadline is None else os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if deadline is not None and time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the child process hung: killed after {timeout} s")
        time.sleep(0.02)


class PausedThread(threading.Thread):
    """Runs ``fn`` on a daemon thread that stops right after its first call of a C function
    that ``stop_after`` picks, made from the Python function ``where``, returns; it goes on at
    ``resume()``.  One chosen interleaving of threads, made every time with a profile hook (as
    a debugger would) and no change to the code under test.  ``result`` or ``error`` tell
    how ``fn`` ended."""

    def __init__(
        self,
        fn: Callable[[], Any],
        where: Callable[..., Any],
        stop_after: Callable[[Any], bool],
        timeout: float = 10.0,
    ) -> None:
        super().__init__(daemon=True, name=f"paused in {where.__name__}")
        self.fn, self.code, self.stop_after, self.timeout = fn, where.__code__, stop_after, timeout
        self.paused, self._go = threading.Event(), threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_return" and frame.f_code is self.code and not self.paused.is_set() and self.stop_after(arg):
            self.paused.set()
            self._go.wait(self.timeout)

    def run(self) -> None:
        sys.setprofile(self._profile)
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed to the test
            self.error = exc
        finally:
            sys.setprofile(None)

    def start_and_pause(self) -> None:
        """Start the thread and wait until it stops (AssertionError after ``timeout``)."""
        self.start()
        assert self.paused.wait(self.timeout), f"the thread {self.name} never reached its pause"

    def resume(self) -> None:
        self._go.set()


def after_read(fn: Any) -> bool:
    """For PausedThread: stop after ``os.read``."""
    return fn is os.read


_POLL_TYPE = type(select.poll())


def after_poll(fn: Any) -> bool:
    """For PausedThread: stop after a ``select.poll`` object's ``poll()`` (not its ``register()``)."""
    return getattr(fn, "__name__", "") == "poll" and isinstance(getattr(fn, "__self__", None), _POLL_TYPE)


@pytest.fixture(scope="session")
def gpupin_loaded() -> None:
    if NATIVE:
        if not os.path.exists("/dev/gpupin"):
            _unavailable("GPUPIN_NATIVE=1 but /dev/gpupin is missing: load nvidia and gpupin first")
        return
    if os.geteuid() != 0:
        _unavailable("loading the modules needs root (run 'make test-vm')")
    if not os.path.exists("/proc/modules") or not os.access("/proc/modules", os.R_OK):
        _unavailable("this kernel has no module support")
    try:
        ensure_loaded()
    except ModuleError as exc:
        _unavailable(f"cannot load the modules here: {exc} (run 'make test-vm')")


@pytest.fixture
def leakcheck(gpupin_loaded: None) -> Iterator[None]:
    yield
    if NATIVE:
        return
    leaks = sim_stats().leaks()
    assert not leaks, f"simulator counters not back to zero after the test: {leaks}"


@pytest.fixture
def device(leakcheck: None) -> Iterator[Device]:
    dev = Device()
    yield dev
    dev.close()


@pytest.fixture
def sim(leakcheck: None) -> Iterator[SimMemory]:
    if NATIVE:
        pytest.skip("needs the nvp2p_sim simulator (native mode)")
    mem = SimMemory()
    yield mem
    mem.close()


@pytest.fixture
def peer(leakcheck: None) -> Iterator[Peer]:
    """An open /dev/gpupin_peer (the example peer driver).  Natively it maps for the PCI
    device named by GPUPIN_PEER_PCI (a NIC) and copies through the GPU's BAR1."""
    pci = os.environ.get("GPUPIN_PEER_PCI") or None
    if NATIVE and not pci:
        pytest.skip(
            "the peer needs a NIC's PCI address (DDDD:BB:DD.F, see 'lspci -D'): make test-native PEER_PCI=..., "
            "or GPUPIN_PEER_PCI=... for pytest run by hand"
        )
    load_peer(pci)
    p = Peer()
    yield p
    p.close()


@pytest.fixture
def memory(leakcheck: None) -> Iterator[MemoryProvider]:
    mem: Any
    if NATIVE:
        from ..cuda import CudaMemory

        mem = CudaMemory()
    else:
        mem = SimMemory()
    yield mem
    mem.close()


@pytest.fixture
def sim_params(gpupin_loaded: None) -> Iterator[Any]:
    """``sim_params(module, name=value, ...)`` for this test; old values come back after."""
    with contextlib.ExitStack() as saved:  # restores in reverse order

        def setter(module: str = "nvp2p_sim", **values: object) -> None:
            for name, value in values.items():
                saved.enter_context(module_param(module, name, value))

        yield setter


class ShellOnPty:
    """``gpupin shell`` on a pseudo-terminal, typed into as a developer would: the
    prompt, tab completion, Ctrl-C and Ctrl-D behave as in a terminal.  ``history``
    is its history file; each wait gives up after ``timeout`` seconds.  With
    ``sigint_ignored`` the shell starts as a job started with '&' by a non-interactive shell
    does: SIGINT ignored, and blocked too."""

    def __init__(self, history: str, timeout: float = 30.0, *, sigint_ignored: bool = False) -> None:
        self.timeout = timeout
        self._pending = b""  # printed after the token the last read_until waited for
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child only execs: never back into the caller's code
            try:
                os.environ["GPUPIN_HISTORY"] = history
                if sigint_ignored:  # both survive exec
                    signal.signal(signal.SIGINT, signal.SIG_IGN)
                    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
                os.execv(sys.executable, [sys.executable, "-m", "gpupin", "shell"])
            finally:
                os._exit(127)  # public, despite the underscore: exit without cleanup

    def write(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def interrupt(self) -> None:
        """Ctrl-C, typed as a person would: not within microseconds of the last prompt.
        CPython's readline loop (readline_until_enter_or_signal) looks at signals only when
        its select() is interrupted; a SIGINT that lands after the line is redrawn but before
        select() is entered again waits for the next key, and the test waited for "^C" in
        vain (about once in five host-suite runs under load)."""
        time.sleep(0.25)
        os.write(self.fd, b"\x03")

    def _read(self, wait: float) -> bytes | None:
        """What the shell printed within ``wait`` seconds (b"" if nothing); None once it closed."""
        ready, _, _ = select.select([self.fd], [], [], max(wait, 0))
        if not ready:
            return b""
        try:
            return os.read(self.fd, 4096) or None
        except OSError:  # EIO: the shell's side is closed
            return None

    def read_until(self, token: bytes) -> bytes:
        """What the shell printed up to and including ``token``; the rest stays for the
        next call (AssertionError on timeout)."""
        buf, self._pending = self._pending, b""
        deadline = time.monotonic() + self.timeout
        while token not in buf:
            left = deadline - time.monotonic()
            assert left > 0, f"the shell did not print {token!r} within {self.timeout} s; it printed {buf!r}"
            chunk = self._read(left)
            if chunk is None:
                raise AssertionError(f"the shell ended before printing {token!r}; it printed {buf!r}")
            buf += chunk
        end = buf.index(token) + len(token)
        self._pending = buf[end:]
        return buf[:end]

    def close(self) -> int:
        """Wait for the shell to leave (killed after the timeout); its exit status."""
        deadline = time.monotonic() + self.timeout
        done, status = 0, 0
        while done == 0 and time.monotonic() < deadline:
            self._read(0.1)  # keep its output flowing so it never blocks writing
            done, status = os.waitpid(self.pid, os.WNOHANG)
        if done == 0:
            os.kill(self.pid, 9)
            _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status)
