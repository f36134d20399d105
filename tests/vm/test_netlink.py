"""The generic-netlink family: introspection, events, privilege, strict validation; over
either provider except where a test forks, reloads the module or sets a simulator knob."""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
import time

import pytest
from pyroute2.netlink import genlmsg

import gpupin
from conftest import GPU_PAGE, SLOW, MiB
from gpupin import Device, MemoryProvider, SimMemory, kmod, netlink
from gpupin.testing import ensure_loaded

pytestmark = pytest.mark.vm
FORKS = pytest.mark.simonly(reason="forks a child that holds pins on device memory: CUDA contexts do not survive fork")
RELOADS = pytest.mark.simonly(reason="unloads gpupin.ko and loads a build of it made against the simulator")
NOBODY = 65534


def test_info_matches_ioctl(device: Device) -> None:
    info = netlink.info()
    i = device.info()
    assert info["abi_version"] == i.abi_version and info["provider"] == i.provider
    assert info["caps"] == i.caps and info["version"] == i.version


def collect(nl: netlink.Netlink, n: int) -> list[dict]:  # type: ignore[type-arg]
    return list(nl.events(timeout=10, count=n))


def test_event_order_and_content(device: Device, memory: MemoryProvider, pci: str) -> None:
    with netlink.Netlink() as nl:
        nl.subscribe()
        va = memory.alloc(2 * MiB)
        pin = device.pin(va + 100, GPU_PAGE, user_tag=0x5EED)
        device.dma_map(pin, pci)
        memory.free(va)
        device.unpin(pin)
        evs = collect(nl, 3)
    assert [e["event"] for e in evs] == ["pinned", "invalidated", "unpinned"]
    for e in evs:
        assert e["pid"] == os.getpid() and e["handle"] == pin.handle and e["user_tag"] == 0x5EED
        assert e["va"] == va + 100 and e["aligned_va"] == va and e["aligned_size"] == 2 * GPU_PAGE
        assert e["gpu_uuid"] == netlink.gpu_uuid_text(pin.gpu_uuid) != ""
    assert evs[0]["state"] == "pinned" and evs[0]["reason"] is None
    assert evs[1]["reason"] == "freed" and evs[1]["state"] == "invalidated"
    assert evs[1]["dma_peers"] == []  # the callback took the mapping away first
    assert evs[2]["reason"] == "unpin"


@FORKS
def test_process_exit_and_budget_events(gpupin_loaded: None, leakcheck: None, sim_params) -> None:  # type: ignore[no-untyped-def]
    sim_params("gpupin", max_pinned_bytes=GPU_PAGE)
    with netlink.Netlink() as nl:
        nl.subscribe()
        pid = os.fork()
        if pid == 0:
            sim = SimMemory()
            dev = Device()
            va = sim.alloc(2 * GPU_PAGE)
            dev.pin(va, GPU_PAGE)
            try:
                dev.pin(va + GPU_PAGE, GPU_PAGE)
            except gpupin.BudgetExceeded:
                os._exit(0)  # dies holding a pin
            os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        evs = collect(nl, 3)
    assert [e["event"] for e in evs] == ["pinned", "budget_exhausted", "unpinned"]
    assert evs[1]["pid"] == pid and evs[1]["size"] == GPU_PAGE and evs[1]["max_pinned_bytes"] == GPU_PAGE
    assert evs[2]["reason"] == "process_exit"


def test_no_budget_event_for_a_full_slot_table(gpupin_loaded: None, leakcheck: None, sim_params) -> None:  # type: ignore[no-untyped-def]
    """BUDGET_EXHAUSTED is max_pinned_bytes' event (its figures are that budget's): a PIN
    refused because its file's slots are taken (max_pins_per_file, ENOSPC too) sent one,
    with byte figures that said nothing of why."""
    sim_params("gpupin", max_pins_per_file=1)
    with netlink.Netlink() as nl:
        nl.subscribe()
        sim = SimMemory()
        dev = Device()
        try:
            va = sim.alloc(2 * GPU_PAGE)
            pin = dev.pin(va, GPU_PAGE)
            with pytest.raises(gpupin.GpupinError) as ei:
                dev.pin(va + GPU_PAGE, GPU_PAGE)
            assert ei.value.errno == errno.ENOSPC
            dev.unpin(pin)
            evs = collect(nl, 2)
        finally:
            dev.close()
            sim.close()
    assert [e["event"] for e in evs] == ["pinned", "unpinned"], evs


# Many pins, so that the dump spans many netlink messages: 2,000 in make
# test (34 s for 10,000 under TCG), 10,000 in make test-long.
DUMP_PINS = 10_000 if os.environ.get("GPUPIN_LONG") == "1" else 2_000


@pytest.mark.simonly(reason="sets the simulator's BAR size (bar_size) for thousands of pins")
def test_dump_of_thousands_of_pins(device: Device, sim: SimMemory, sim_params) -> None:  # type: ignore[no-untyped-def]
    sim_params(bar_size=1 << 30)
    va = sim.alloc(GPU_PAGE)
    handles = [device.pin(va, GPU_PAGE, user_tag=i).handle for i in range(DUMP_PINS)]
    mine = [p for p in netlink.list_pins() if p.pid == os.getpid()]
    assert [p.handle for p in mine] == handles
    assert [p.user_tag for p in mine] == list(range(DUMP_PINS))
    st = netlink.stats()
    assert st["pins"] >= DUMP_PINS and st["bytes_now"] >= DUMP_PINS * GPU_PAGE
    device.close()  # releases them all
    sim.free(va)


def test_get_pin_and_stats(device: Device, memory: MemoryProvider, pci: str) -> None:
    va = memory.alloc(2 * MiB)
    pin = device.pin(va, MiB, persistent=True)
    device.dma_map(pin, pci)
    with netlink.Netlink() as nl:
        p = nl.get_pin(os.getpid(), pin.handle)
        assert p.handle == pin.handle and p.persistent and p.dma_peers == [pci] and p.entries == 16
        # The GPU the ioctl named, as nvidia-smi prints it: the dump says it too.
        assert p.gpu_uuid == netlink.gpu_uuid_text(pin.gpu_uuid) and p.gpu_uuid.startswith("GPU-")
        with pytest.raises(gpupin.UnknownHandle, match="no pin with that handle"):
            nl.get_pin(os.getpid(), pin.handle + 1000)
        before = nl.stats()
    device.unpin(pin)
    after = netlink.stats()
    assert after["unpins"] == before["unpins"] + 1 and after["dma_maps"] >= 1
    memory.free(va)


class badmsg(genlmsg):  # noqa: N801
    nla_map = (
        (1, "PID_AS_U64", "uint64"),
        (2, "GPUPIN_NL_A_HANDLE", "uint64"),
        (4, "ABI_VERSION", "uint32"),
        (14, "BEYOND_MAX", "uint32"),
    )


@pytest.mark.parametrize(
    "attrs,msg",
    [
        ([("PID_AS_U64", 1), ("GPUPIN_NL_A_HANDLE", 1)], "invalid attribute length|attribute type 1"),
        ([("ABI_VERSION", 1)], "[Uu]nsupported attribute|[Uu]nknown attribute"),
        ([("BEYOND_MAX", 1)], "[Uu]nknown attribute"),
        ([("GPUPIN_NL_A_HANDLE", 1)], "needs the PID and HANDLE"),
    ],
    ids=["wrongtype", "unspec", "unknown", "missing"],
)
def test_malformed_requests_get_extack(gpupin_loaded: None, attrs, msg: str) -> None:  # type: ignore[no-untyped-def]
    from gpupin._native import lib

    with netlink.Netlink(badmsg) as nl:
        with pytest.raises(gpupin.InvalidArgument, match=msg) as ei:
            nl.request(lib.GPUPIN_NL_CMD_GET_PIN, attrs)
    assert "EINVAL" in str(ei.value)


def test_subscribe_where_the_group_exists_says_join_it(gpupin_loaded: None) -> None:
    """SUBSCRIBE is the unicast fallback's; the multicast build refuses it with the way to go."""
    from gpupin._native import lib

    with netlink.Netlink() as nl:
        if "events" not in nl.sock.mcast_groups:
            pytest.skip("this gpupin build has no events group (the unicast fallback)")
        with pytest.raises(gpupin.GpupinError, match='join the "events" multicast group') as ei:
            nl.request(lib.GPUPIN_NL_CMD_SUBSCRIBE)
    assert ei.value.errno == errno.EOPNOTSUPP


@FORKS
def test_unprivileged_sees_only_its_own(device: Device, sim: SimMemory) -> None:
    va = sim.alloc(GPU_PAGE)
    mine = device.pin(va, GPU_PAGE)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            s2, d2 = SimMemory(), Device()
            child_pin = d2.pin(s2.alloc(GPU_PAGE), GPU_PAGE)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            pins = netlink.list_pins()
            ok = [(p.pid, p.handle) for p in pins] == [(os.getpid(), child_pin.handle)]
            with netlink.Netlink() as nl:
                try:
                    nl.get_pin(os.getppid(), mine.handle)
                    ok = False
                except gpupin.UnknownHandle:
                    pass
                try:
                    nl.subscribe()
                    ok = False
                except gpupin.PermissionDenied:
                    pass
            code = 0 if ok else 2
        finally:
            os.write(w, b"x")
            os._exit(code)
    os.read(r, 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    pids = {p.pid for p in netlink.list_pins()}
    assert os.getpid() in pids  # root sees everyone
    device.unpin(mine)
    sim.free(va)


@RELOADS
def test_unload_with_listener_subscribed(gpupin_loaded: None) -> None:
    nl = netlink.Netlink()
    nl.subscribe()
    got: list[object] = []
    t = threading.Thread(target=lambda: got.extend(nl.events(timeout=2)))
    t.start()
    kmod.unload("gpupin")
    try:
        t.join()
        assert got == []
        with pytest.raises(gpupin.DriverNotLoaded, match="gpupin load"):
            netlink.Netlink()
    finally:
        nl.close()
        ensure_loaded()
    assert netlink.info()["provider"] == "nvp2p_sim"


def assert_departed_subscriber_port_gets_nothing(portid: int) -> None:
    """An unprivileged socket that binds a closed subscriber's port id receives no events."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 16)  # NETLINK_GENERIC
            try:
                s.bind((portid, 0))
            except OSError as exc:
                os.write(w, f"bind: {exc}".encode())
                raise
            os.write(w, b"r")
            s.settimeout(2)
            try:
                s.recv(65536)
                code = 2  # got an event meant for the privileged subscriber
            except TimeoutError:
                code = 0
        finally:
            os._exit(code)
    os.close(w)
    got = os.read(r, 200)
    os.close(r)
    assert got == b"r", f"the child could not take port {portid}: {got!r}"

    with SimMemory() as sim, Device() as dev:
        va = sim.alloc(GPU_PAGE)
        dev.unpin(dev.pin(va, GPU_PAGE))
        sim.free(va)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "a departed subscriber's port id still gets events"


@RELOADS
def test_unicast_events_fallback(gpupin_loaded: None, leakcheck: None) -> None:
    """The build for kernels without GENL_MCAST_CAP_NET_ADMIN: SUBSCRIBE + unicast, admin only."""
    from gpupin.kmod import ko_dir

    variant = ko_dir() / "build" / "unicast" / "gpupin.ko"
    assert variant.exists(), "vm-run.sh builds this variant"
    kmod.unload("gpupin")
    try:
        kmod.load(str(variant))
        with netlink.Netlink() as nl:
            assert "events" not in nl.sock.mcast_groups
            nl.subscribe()
            with SimMemory() as sim, Device() as dev:
                va = sim.alloc(GPU_PAGE)
                pin = dev.pin(va, GPU_PAGE, user_tag=11)
                sim.free(va)
                dev.unpin(pin)
            evs = collect(nl, 3)
            with socket.fromfd(nl.sock.fileno(), socket.AF_NETLINK, socket.SOCK_RAW) as dup:
                portid = dup.getsockname()[0]
        assert [(e["event"], e["user_tag"]) for e in evs] == [("pinned", 11), ("invalidated", 11), ("unpinned", 11)]
        assert_departed_subscriber_port_gets_nothing(portid)

        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                with netlink.Netlink() as nl2:
                    try:
                        nl2.subscribe()
                    except gpupin.PermissionDenied:
                        code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        kmod.unload("gpupin")
        ensure_loaded()


NLMSG_ERROR = 2


def _genl_request(s: socket.socket, family: int, cmd: int) -> int:
    """Send one attribute-less generic-netlink request on a raw socket; its ACK's errno."""
    s.send(struct.pack("=IHHII", 20, family, 0x1 | 0x4, 1, 0) + struct.pack("=BBH", cmd, 1, 0))  # REQUEST|ACK
    data = s.recv(65536)
    _, kind = struct.unpack_from("=IH", data)
    assert kind == NLMSG_ERROR, f"no ACK but message type {kind}"
    return -struct.unpack_from("=i", data, 16)[0]


def _genl_events(s: socket.socket, family: int, timeout: float, count: int | None = None) -> list[int]:
    """Commands of the family's messages that arrive on a raw socket within ``timeout`` seconds."""
    cmds: list[int] = []
    deadline = time.monotonic() + timeout
    while count is None or len(cmds) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        s.settimeout(left)
        try:
            data = s.recv(65536)
        except TimeoutError:
            break
        off = 0
        while off + 20 <= len(data):
            length, kind = struct.unpack_from("=IH", data, off)
            if kind == family:
                cmds.append(data[off + 16])
            off += (length + 3) & ~3
    return cmds


def _pin_and_unpin() -> None:
    with SimMemory() as sim, Device() as dev:
        va = sim.alloc(GPU_PAGE)
        dev.unpin(dev.pin(va, GPU_PAGE))
        sim.free(va)


@RELOADS
def test_unicast_subscriber_is_its_socket_not_its_port_id(gpupin_loaded: None, leakcheck: None) -> None:
    """Between a subscriber's netlink_remove() and NETLINK_URELEASE another socket may bind its port id.

    The test build's nl_release_delay_ms holds that window open.  A socket that binds the
    port id there must get none of the old subscriber's events, and its own subscription,
    made there too, must outlive the old socket's release.  Keyed by port id, both fail.
    """
    from gpupin._native import lib
    from gpupin.kmod import ko_dir
    from gpupin.sim import set_module_param

    variant = ko_dir() / "build" / "unicast" / "gpupin.ko"
    assert variant.exists(), "vm-run.sh builds this variant"
    kmod.unload("gpupin")
    old = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 16)  # NETLINK_GENERIC
    new = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 16)
    try:
        kmod.load(str(variant))
        with netlink.Netlink() as nl:
            family = nl.sock.prid
        old.bind((0, 0))
        portid = old.getsockname()[0]
        assert _genl_request(old, family, lib.GPUPIN_NL_CMD_SUBSCRIBE) == 0
        set_module_param("gpupin", "nl_release_delay_ms", 4000)
        closer = threading.Thread(target=old.close)
        closer.start()
        deadline = time.monotonic() + 3
        while True:
            try:
                new.bind((portid, 0))
                break
            except OSError as exc:
                assert exc.errno == errno.EADDRINUSE and time.monotonic() < deadline, exc
                time.sleep(0.001)
        assert closer.is_alive(), "the old socket's release ended before its port id was taken: no window"

        _pin_and_unpin()
        assert _genl_events(new, family, 0.5) == [], "a socket that took a subscriber's port id got its events"
        assert _genl_request(new, family, lib.GPUPIN_NL_CMD_SUBSCRIBE) == 0
        assert closer.is_alive(), "the window closed before the new socket subscribed"
        closer.join()
        set_module_param("gpupin", "nl_release_delay_ms", 0)

        _pin_and_unpin()
        got = _genl_events(new, family, 10, count=2)
        assert got == [lib.GPUPIN_NL_CMD_PINNED, lib.GPUPIN_NL_CMD_UNPINNED], "the new subscription went with the old"
    finally:
        new.close()
        old.close()
        kmod.unload("gpupin")
        ensure_loaded()


def _detach_by_a_fork_childs_last_close(dev: Device) -> None:
    """Close ``dev`` here and let a fork child close the last copy: its pins go DETACHED."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        os.read(r, 1)  # the parent closed its copy: ours is the last
        os._exit(0)  # the gpupin file's release runs here, in the child
    os.close(r)
    dev.close()
    os.write(w, b"x")
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _wait_for_stat(name: str, want: int) -> dict[str, int]:
    deadline = time.monotonic() + 10 * SLOW
    while (st := netlink.stats())[name] != want:
        assert time.monotonic() < deadline, f"stats[{name!r}] = {st[name]}, not {want}"
        time.sleep(0.01)
    return st


@FORKS
def test_detached_pins_are_dumped_and_counted(gpupin_loaded: None, leakcheck: None) -> None:
    """A pin released where its pages cannot be put (a fork child's last close) is out of
    its file's handle table but holds its pages and budget until the GPU memory is freed:
    the dump lists it as detached, GET_STATS counts it and its bytes, until the callback."""
    before = netlink.stats()
    with SimMemory() as sim:
        dev = Device()
        va = sim.alloc(3 * GPU_PAGE)
        pins = [dev.pin(va, GPU_PAGE, user_tag=0xD1), dev.pin(va + GPU_PAGE, 2 * GPU_PAGE, user_tag=0xD2)]
        (file_id,) = {p.file_id for p in netlink.list_pins() if p.pid == os.getpid()}
        _detach_by_a_fork_childs_last_close(dev)
        st = _wait_for_stat("detached", before["detached"] + 2)
        assert st["detached_bytes"] == before["detached_bytes"] + 3 * GPU_PAGE
        assert st["bytes_now"] >= st["detached_bytes"]  # they still hold their budget
        mine = [p for p in netlink.list_pins() if p.pid == os.getpid()]
        assert [(p.file_id, p.handle, p.state, p.user_tag, p.aligned_size) for p in mine] == [
            (file_id, pins[0].handle, "detached", 0xD1, GPU_PAGE),
            (file_id, pins[1].handle, "detached", 0xD2, 2 * GPU_PAGE),
        ]
        sim.free(va)  # NVIDIA's free callback releases them
        st = _wait_for_stat("detached", before["detached"])
        assert st["detached_bytes"] == before["detached_bytes"]
        assert [p for p in netlink.list_pins() if p.pid == os.getpid()] == []


@FORKS
def test_dump_of_many_detached_pins_resumes(gpupin_loaded: None, leakcheck: None, sim_params) -> None:  # type: ignore[no-untyped-def]
    """More detached pins than one dump message holds or one batch takes: each listed once, in order,
    after the pins still in a handle table."""
    sim_params(bar_size=1 << 30)
    n = 300
    before = netlink.stats()["detached"]
    with SimMemory() as sim, Device() as live:
        va = sim.alloc(GPU_PAGE)
        kept = live.pin(va, GPU_PAGE, user_tag=1)
        dev = Device()
        handles = [dev.pin(va, GPU_PAGE, user_tag=i).handle for i in range(n)]
        _detach_by_a_fork_childs_last_close(dev)
        _wait_for_stat("detached", before + n)
        mine = [p for p in netlink.list_pins() if p.pid == os.getpid()]
        assert [(p.handle, p.state) for p in mine[:1]] == [(kept.handle, "pinned")]
        assert [p.handle for p in mine[1:]] == handles and {p.state for p in mine[1:]} == {"detached"}
        assert [p.user_tag for p in mine[1:]] == list(range(n))
        live.unpin(kept)
        sim.free(va)
        _wait_for_stat("detached", before)
