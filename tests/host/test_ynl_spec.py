"""The netlink family's one source, Documentation/netlink/specs/gpupin.yaml, and what follows from it.

include/uapi/gpupin_netlink.h and the kernel's policies and ops (kernel/netlink-gen.c and .h) are
generated from the spec (scripts/gen-netlink-header.py, `make netlink-header`);
scripts/ci/check-netlink.sh (`make check`) generates them again and fails while a committed one
differs: it must pass here, and fail on a changed spec or a hand-edited file.
The numbers the C compiler gives the header's names (read through the cffi extension) must be the
ones YNL gives the spec, and the Python client must decode each attribute as the spec types it.
tests/vm/test_ynl.py then talks to the module with the kernel's own YNL client.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is part of the test extra: make setup")

from gpupin import netlink  # noqa: E402
from gpupin._native import lib  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SPEC_REL = Path("Documentation/netlink/specs/gpupin.yaml")
SPEC = ROOT / SPEC_REL
# The generated files, relative to the tree (their #include lines name each other so).
GENERATED = ("include/uapi/gpupin_netlink.h", "kernel/netlink-gen.c", "kernel/netlink-gen.h")
CHECK = ROOT / "scripts/ci/check-netlink.sh"
PYROUTE2_TYPE = {"u32": "uint32", "u64": "uint64", "string": "asciiz", "flag": "flag", "binary": "cdata"}


def c_name(prefix: str, name: str) -> str:
    return (prefix + name).upper().replace("-", "_")


def numbered(items: list[Any], start: int) -> list[tuple[int, dict[str, Any]]]:
    """YNL numbering: an explicit value, else one more than the previous item."""
    out, nxt = [], start
    for it in items:
        it = it if isinstance(it, dict) else {"name": it}
        v = it.get("value", nxt)
        out.append((v, it))
        nxt = v + 1
    return out


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return yaml.safe_load(SPEC.read_text())


def run_check(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PY=sys.executable)
    return subprocess.run([str(CHECK), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_the_committed_header_is_generated_from_the_spec() -> None:
    r = run_check(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("changed", ["spec", "check", "header", "kernel"])
def test_the_check_fails_when_a_generated_file_and_the_spec_differ(tmp_path: Path, changed: str) -> None:
    """A copy of the tree's spec and generated files, laid out as in the tree: the check passes on
    the copy as it is (the files name the spec by the same relative path), then fails once the
    spec or any file is changed."""
    spec = tmp_path / SPEC_REL
    spec.parent.mkdir(parents=True)
    shutil.copy(SPEC, spec)
    for rel in GENERATED:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    header, source = tmp_path / GENERATED[0], tmp_path / GENERATED[1]
    args = (str(SPEC_REL), *GENERATED)
    r = run_check(tmp_path, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    text = spec.read_text()
    if changed == "spec":  # a counter inserted before the last one: that one's number changes
        last = "      -\n        name: detached-bytes\n"
        assert text.count(last) == 1
        spec.write_text(text.replace(last, "      -\n        name: fail-eagain\n        type: u64\n" + last))
        added = "+\tGPUPIN_NL_STAT_A_FAIL_EAGAIN,"
    elif changed == "check":  # the PID's minimum: GET_PINS's policy changes, GET_PIN's (its own) not
        check = "        checks:\n          min: 1\n"
        assert text.count(check) == 1
        spec.write_text(text.replace(check, "        checks:\n          min: 2\n"))
        added = "+\t[GPUPIN_NL_A_PID] = NLA_POLICY_MIN(NLA_U32, 2),"
    elif changed == "header":
        pad = "\tGPUPIN_NL_A_PAD,\n"
        header.write_text(header.read_text().replace(pad, pad + "\tGPUPIN_NL_A_NEW,\n"))
        added = "-\tGPUPIN_NL_A_NEW,"
    else:  # the kernel source edited by hand: SUBSCRIBE open to all
        admin = "\t\t.flags = GENL_ADMIN_PERM,\n"
        assert source.read_text().count(admin) == 1
        source.write_text(source.read_text().replace(admin, ""))
        added = "+\t\t.flags = GENL_ADMIN_PERM,"
    r = run_check(tmp_path, *args)
    assert r.returncode == 1, r.stdout + r.stderr
    assert added in r.stdout.splitlines(), r.stdout
    assert sum(line.startswith("+++ ") for line in r.stdout.splitlines()) == 1, "one file differs: one diff"
    assert "make netlink-header" in r.stderr


def test_the_header_numbers_are_the_ones_ynl_gives_the_spec(spec: dict[str, Any]) -> None:
    """What the kernel compiles (the header) against what YNL clients send (the spec)."""
    groups = [(spec["operations"]["name-prefix"], numbered(spec["operations"]["list"], 1))]
    sets = [s for s in spec["attribute-sets"] if "subset-of" not in s]  # a subset's names are its parent's
    groups += [(s["name-prefix"], numbered(s["attributes"], 1)) for s in sets]
    groups += [(d["name-prefix"], numbered(d["entries"], d.get("value-start", 0))) for d in spec["definitions"]]
    for prefix, items in groups:
        declared = {n for n in dir(lib) if n.startswith(c_name(prefix, "")) and n != c_name(prefix, "max")}
        assert declared == {c_name(prefix, it["name"]) for _, it in items}, prefix
        for value, it in items:
            name = c_name(prefix, it["name"])
            assert getattr(lib, name) == value, f"{name}: the spec says {value}, the header {getattr(lib, name)}"
    assert lib.GPUPIN_NL_CMD_MAX == max(v for v, _ in groups[0][1])


@pytest.mark.parametrize("set_name", ["gpupin", "pin", "stats"])
def test_the_python_client_decodes_the_spec_types(spec: dict[str, Any], set_name: str) -> None:
    aset = next(s for s in spec["attribute-sets"] if s["name"] == set_name)
    nla = {"gpupin": netlink.gpupinmsg, "pin": netlink.gpupinmsg.pin, "stats": netlink.gpupinmsg.stats}[set_name]
    client = {num: (name, kind) for num, name, kind in nla.nla_map}
    values = numbered(aset["attributes"], 1)
    assert set(client) == {v for v, _ in values}, "the Python client and the spec know different attributes"
    for value, attr in values:
        name, kind = client[value]
        assert name == c_name(aset["name-prefix"], attr["name"])
        if attr["type"] not in ("unused", "pad"):
            want = PYROUTE2_TYPE.get(attr["type"], attr.get("nested-attributes"))
            assert kind.split("|")[0] == want, f"{name}: spec type {attr['type']}, the Python client decodes {kind}"


def test_the_python_client_names_events_reasons_and_states_as_the_spec(spec: dict[str, Any]) -> None:
    def names(entries: list[Any]) -> set[str]:
        return {(e["name"] if isinstance(e, dict) else e).replace("-", "_") for e in entries}

    events = [op for op in spec["operations"]["list"] if "event" in op]
    assert set(netlink.EVENT_NAMES.values()) == names(events)
    enums = {d["name"]: d["entries"] for d in spec["definitions"]}
    assert set(netlink.REASON_NAMES.values()) == names(enums["reason"])
    assert set(netlink.STATE_NAMES.values()) == names(enums["state"])


def test_the_spec_is_valid_under_the_kernels_schema(spec: dict[str, Any]) -> None:
    """Fast feedback for what tests/vm/test_ynl.py finds out too: the YNL library validates the
    spec against the kernel's genetlink-c schema before it sends anything."""
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is part of the test extra: make setup")
    cache = Path(os.environ.get("GPUPIN_CACHE", "/var/cache/gpupin")) / "ynl"
    dirs = [Path(os.environ["GPUPIN_YNL_DIR"])] if os.environ.get("GPUPIN_YNL_DIR") else []
    found = [d / "Documentation/netlink/genetlink-c.yaml" for d in dirs + sorted(cache.glob("*"))]
    schemas = [p for p in found if p.exists()]
    if not schemas:
        pytest.skip(f"no kernel YNL schema under {cache}: scripts/ynl-fetch.sh (run by the VM suite) fetches it")
    jsonschema.Draft7Validator(yaml.safe_load(schemas[0].read_text())).validate(spec)
