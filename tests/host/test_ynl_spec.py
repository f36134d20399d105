"""The YNL spec of the netlink family against the UAPI header and the Python client.

Documentation/netlink/specs/gpupin.yaml, include/uapi/gpupin_netlink.h (read
through the cffi extension, so the numbers are the C compiler's) and the
pyroute2 message classes in gpupin.netlink must name and number every
command and attribute alike.  tests/vm/test_ynl.py then talks to the module
with the kernel's own YNL client.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is part of the test extra: make setup")

from gpupin._native import lib  # noqa: E402
from gpupin.netlink import gpupinmsg  # noqa: E402

SPEC = Path(__file__).resolve().parents[2] / "Documentation" / "netlink" / "specs" / "gpupin.yaml"
PYROUTE2_TYPE = {"u32": "uint32", "u64": "uint64", "string": "asciiz", "flag": "flag"}


def c_name(prefix: str, name: str) -> str:
    return (prefix + name).upper().replace("-", "_")


def numbered(items: list[dict[str, Any]], start: int = 0) -> list[tuple[int, dict[str, Any]]]:
    """YNL numbering: an explicit value, else one more than the previous item."""
    out, nxt = [], start
    for it in items:
        v = it.get("value", nxt)
        out.append((v, it))
        nxt = v + 1
    return out


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return yaml.safe_load(SPEC.read_text())


def test_commands_match_the_header(spec: dict[str, Any]) -> None:
    ops = spec["operations"]
    seen = {}
    for value, op in numbered(ops["list"], 1):
        name = c_name(ops["name-prefix"], op["name"])
        assert getattr(lib, name) == value, f"{name}: spec says {value}, the header {getattr(lib, name)}"
        seen[name] = value
    assert lib.GPUPIN_NL_CMD_MAX == max(seen.values())
    # every command the header declares is in the spec
    declared = {n for n in dir(lib) if n.startswith("GPUPIN_NL_CMD_") and n != "GPUPIN_NL_CMD_MAX"}
    assert declared == set(seen)


@pytest.mark.parametrize("set_name", ["gpupin", "pin", "stats"])
def test_attributes_match_the_header_and_the_python_client(spec: dict[str, Any], set_name: str) -> None:
    aset = next(s for s in spec["attribute-sets"] if s["name"] == set_name)
    nla = {"gpupin": gpupinmsg, "pin": gpupinmsg.pin, "stats": gpupinmsg.stats}[set_name]
    client = {num: (name, kind) for num, name, kind in nla.nla_map}
    values = []
    for value, attr in numbered(aset["attributes"]):
        name = c_name(aset["name-prefix"], attr["name"])
        assert getattr(lib, name) == value, f"{name}: spec says {value}, the header {getattr(lib, name)}"
        values.append(value)
        cname, ckind = client[value]
        assert cname == name, f"attribute {value} of {set_name}: the Python client calls it {cname}"
        want = PYROUTE2_TYPE.get(attr["type"], attr.get("nested-attributes", "none"))
        if attr["type"] not in ("unused", "pad"):
            assert ckind == want, f"{name}: spec type {attr['type']}, the Python client decodes it as {ckind}"
    assert getattr(lib, c_name(aset["name-prefix"], "max")) == max(values)
    assert set(client) == set(values), "the Python client knows attributes the spec does not"


def test_enums_match_the_header(spec: dict[str, Any]) -> None:
    for d in spec["definitions"]:
        for value, e in numbered([x if isinstance(x, dict) else {"name": x} for x in d["entries"]], d["value-start"]):
            name = c_name(d["name-prefix"], e["name"])
            assert getattr(lib, name) == value, name


def test_family_name_group_and_events(spec: dict[str, Any]) -> None:
    import re

    header = (SPEC.parents[3] / "include" / "uapi" / "gpupin_netlink.h").read_text()
    strings = dict(re.findall(r'^#define (GPUPIN_NL_\w+)\s+"([^"]*)"', header, re.M))
    assert strings["GPUPIN_NL_FAMILY_NAME"] == spec["name"]
    groups = {g["name"] for g in spec["mcast-groups"]["list"]}
    assert groups == {strings["GPUPIN_NL_MCGRP_EVENTS"]}
    events = [op for op in spec["operations"]["list"] if "event" in op]
    assert {op["name"] for op in events} == {"pinned", "unpinned", "invalidated", "budget-exhausted"}
    assert all(op["mcgrp"] in groups for op in events)
