"""The kernel's own YNL client talks to the family through Documentation/netlink/specs/gpupin.yaml.

The YNL library (tools/net/ynl of Debian's linux-source-6.12, fetched by
scripts/ynl-fetch.sh; GPUPIN_YNL_DIR) validates the spec against the
kernel's genetlink-c schema, then every operation and event is exercised and
compared with what gpupin's own client and the ioctls say.  Any disagreement
between spec and module (numbers, types, required attributes, per-operation
policies as the kernel reports them through nlctrl) fails here.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import GPU_ALLOC, GPU_PAGE, MiB
from gpupin import Device, MemoryProvider, SimMemory, netlink
from gpupin.testing import NATIVE

pytestmark = pytest.mark.vm

SPEC = Path(__file__).resolve().parents[2] / "Documentation" / "netlink" / "specs" / "gpupin.yaml"
SPEC_TYPES = {"u32": "u32", "u64": "u64", "string": "nul-string", "flag": "flag", "nest": "nested"}


def _ynl_dir() -> Path:
    d = os.environ.get("GPUPIN_YNL_DIR", "")
    if not d or not (Path(d) / "tools/net/ynl/lib/ynl.py").exists():
        if NATIVE:
            pytest.skip(f"GPUPIN_YNL_DIR={d!r} holds no tools/net/ynl: scripts/ynl-fetch.sh fetches it")
        pytest.fail(f"GPUPIN_YNL_DIR={d!r} holds no tools/net/ynl: run the VM suite through scripts/vm-run.sh")
    return Path(d)


@pytest.fixture(scope="module")
def ynl_lib() -> Any:
    root = _ynl_dir()
    sys.path.insert(0, str(root / "tools/net/ynl"))
    import lib  # the kernel's YNL library

    return lib, root


def family(ynl_lib: Any, spec: Path = SPEC, schema: str = "genetlink-c.yaml") -> Any:
    lib, root = ynl_lib
    return lib.YnlFamily(str(spec), str(root / "Documentation/netlink" / schema))


def test_get_info_and_stats_match_the_module(ynl_lib: Any, device: Device) -> None:
    y = family(ynl_lib)
    info = y.do("get-info", {})
    mine = netlink.info()
    i = device.info()
    assert info["abi-version"] == i.abi_version and info["provider"] == i.provider == mine["provider"]
    assert info["version"] == i.version and info["caps"] == i.caps
    assert info["max-pins-per-file"] == mine["max_pins_per_file"]
    stats = y.do("get-stats", {})["stats"]
    spec_stats = {
        "pins",
        "unpins",
        "inval-freed",
        "inval-process-exit",
        "dma-maps",
        "bytes-now",
        "bytes-peak",
        "fail-enomem",
        "fail-enospc",
        "fail-einval",
        "fail-other",
        "callback-max-ns",
        "detached",
        "detached-bytes",
        "fail-edquot",
    }
    assert set(stats) == spec_stats
    assert {k.replace("-", "_") for k in stats} == set(netlink.stats())


def test_dump_and_get_a_pin(ynl_lib: Any, device: Device, memory: MemoryProvider, pci: str) -> None:
    y = family(ynl_lib)
    va = memory.alloc(2 * MiB)
    pin = device.pin(va + 100, GPU_PAGE, user_tag=0x7A6)
    device.dma_map(pin, pci)
    try:
        mine = [m["pin"] for m in y.dump("get-pins", {"pid": os.getpid()})]
        assert [p["handle"] for p in mine] == [pin.handle]
        p = mine[0]
        assert (p["va"], p["size"], p["aligned-va"], p["aligned-size"]) == (va + 100, GPU_PAGE, va, 2 * GPU_PAGE)
        assert p["user-tag"] == 0x7A6 and p["state"] == "pinned" and p["pid"] == os.getpid()
        assert p["entries"] == pin.entries and p["dma-peer"] == [pci]
        assert all(m["pin"]["pid"] != os.getpid() for m in y.dump("get-pins", {"pid": 1}))
        with pytest.raises(ynl_lib[0].NlError) as ei:
            y.dump("get-pins", {"pid": 0})  # the spec's and the kernel's min: 1
        assert ei.value.error == errno.ERANGE and ".pid" in str(ei.value)  # integer out of range
        one = y.do("get-pin", {"pid": os.getpid(), "handle": pin.handle})["pin"]
        assert one == p
        with pytest.raises(ynl_lib[0].NlError) as ei:
            y.do("get-pin", {"pid": os.getpid()})  # HANDLE is required
        assert ei.value.error == errno.EINVAL and "handle" in str(ei.value)
        with pytest.raises(ynl_lib[0].NlError) as ei:
            y.do("get-info", {"pid": 1})  # GET_INFO takes no attributes
        assert ei.value.error == errno.EINVAL
    finally:
        device.unpin(pin)
        memory.free(va)


def test_events_decode_with_the_spec(ynl_lib: Any, device: Device, memory: MemoryProvider) -> None:
    y = family(ynl_lib)
    if "events" in y.mcast_groups:
        y.ntf_subscribe("events")
    else:  # a kernel without CAP_NET_ADMIN-only groups: unicast subscription
        y.do("subscribe", {})
    va = memory.alloc(GPU_ALLOC)
    pin = device.pin(va, GPU_PAGE, user_tag=0xE7)
    memory.free(va)
    device.unpin(pin)
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(seen) < 3:
        y.check_ntf()
        seen += [m for m in y.async_msg_queue if m["msg"].get("pin", {}).get("handle") == pin.handle]
        y.async_msg_queue.clear()
        time.sleep(0.05)
    assert [m["name"] for m in seen] == ["pinned", "invalidated", "unpinned"]
    assert seen[1]["msg"]["pin"]["reason"] == "freed" and seen[2]["msg"]["pin"]["reason"] == "unpin"
    assert all(m["msg"]["pin"]["user-tag"] == 0xE7 for m in seen)


def test_kernel_policies_match_the_spec(ynl_lib: Any, gpupin_loaded: None) -> None:
    """nlctrl's policy dump of the family against each operation's request attributes in the spec,
    their types and minimums (a subset set's own checks where it has them: the generated policies'
    reading, kernel/netlink-gen.c)."""
    import yaml

    lib, root = ynl_lib
    ctrl = family(ynl_lib, root / "Documentation/netlink/specs/nlctrl.yaml", "genetlink-legacy.yaml")
    y = family(ynl_lib)
    op_policy: dict[int, dict[str, int]] = {}
    policies: dict[int, dict[int, dict[str, Any]]] = {}
    # One message per operation ("op-policy": op-id, do/dump policy index) and one per
    # policy attribute ("policy": policy-id, attr-id, type ...).
    for m in ctrl.dump("getpolicy", {"family-name": "gpupin"}):
        if "op-policy" in m:
            op = m["op-policy"]
            op_policy.setdefault(op["op-id"], {}).update({k: op[k] for k in ("do", "dump") if k in op})
        if "policy" in m:
            p = m["policy"]
            policies.setdefault(p["policy-id"], {})[p["attr-id"]] = p
    spec = yaml.safe_load(SPEC.read_text())
    sets = {s["name"]: s for s in spec["attribute-sets"]}
    attrs = {a["name"]: a for a in sets["gpupin"]["attributes"]}
    ids = {name: y.attr_sets["gpupin"][name].value for name in attrs}
    checked = 0
    for op in spec["operations"]["list"]:
        if "do" not in op and "dump" not in op:  # an event, or unspec (a reserved number)
            continue
        value = y.ops[op["name"]].value
        kind = "do" if "do" in op else "dump"
        assert value in op_policy and kind in op_policy[value], f"{op['name']}: the kernel has no {kind} policy"
        kernel = policies.get(op_policy[value][kind], {})
        accepted = {a: d for a, d in kernel.items() if d.get("type") not in (None, "invalid", "reject")}
        want = (op[kind].get("request") or {}).get("attributes", [])
        assert set(accepted) == {ids[n] for n in want}, f"{op['name']}: kernel accepts {sorted(accepted)}, spec {want}"
        aset = sets[op["attribute-set"]]
        own = {a["name"]: a for a in aset["attributes"]} if "subset-of" in aset else {}
        for n in want:
            got = accepted[ids[n]]
            assert got["type"] == SPEC_TYPES[attrs[n]["type"]], f"{op['name']}.{n}"
            checks = (own[n] if "checks" in own.get(n, {}) else attrs[n]).get("checks") or {}
            if "min-value-u" in got:
                assert got["min-value-u"] == checks.get("min", 0), f"{op['name']}.{n}: kernel min {got['min-value-u']}"
        checked += 1
    assert checked == 5


@pytest.mark.simonly(reason="forks a child that holds a pin on device memory: CUDA contexts do not survive fork")
def test_a_detached_pin_decodes_with_the_spec(ynl_lib: Any, gpupin_loaded: None, leakcheck: None) -> None:
    """The spec's state enum names the kernel's DETACHED, and GET_STATS's detached counters add up."""
    y = family(ynl_lib)
    before = y.do("get-stats", {})["stats"]
    with SimMemory() as sim:
        dev = Device()
        va = sim.alloc(GPU_PAGE)
        pin = dev.pin(va, GPU_PAGE, user_tag=0xDE7)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(w)
            os.read(r, 1)
            os._exit(0)  # the last close of the gpupin file: here, where its pages cannot be put
        os.close(r)
        dev.close()
        os.write(w, b"x")
        os.close(w)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "the child that closed the file last failed"
        mine = [m["pin"] for m in y.dump("get-pins", {"pid": os.getpid()})]
        stats = y.do("get-stats", {})["stats"]
        sim.free(va)
    assert [(p["handle"], p["state"], p["user-tag"]) for p in mine] == [(pin.handle, "detached", 0xDE7)]
    assert stats["detached"] == before["detached"] + 1
    assert stats["detached-bytes"] == before["detached-bytes"] + GPU_PAGE
    after = y.do("get-stats", {})["stats"]
    assert (after["detached"], after["detached-bytes"]) == (before["detached"], before["detached-bytes"])
