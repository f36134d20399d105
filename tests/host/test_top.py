"""``gpupin top`` without the module: aggregation, text and JSON from a made-up reading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpupin.netlink import NlPin, gpu_uuid_text
from gpupin.tools import _budget, top

K64 = 64 << 10
GPU_A = gpu_uuid_text(bytes(range(1, 17)))
GPU_B = gpu_uuid_text(bytes(range(17, 33)))

INFO = {"version": "0.1.0", "provider": "nvp2p_sim", "abi_version": 2, "max_pinned_bytes": 0, "pinned_bytes": 0}
STATS = {
    "pins": 10,
    "unpins": 4,
    "inval_freed": 2,
    "inval_process_exit": 1,
    "dma_maps": 1,
    "bytes_now": 5 * K64,
    "bytes_peak": 9 * K64,
    "fail_enomem": 0,
    "fail_enospc": 0,
    "fail_einval": 0,
    "fail_other": 0,
    "callback_max_ns": 12000,
    "detached": 1,
    "detached_bytes": K64,
}


def pin(pid: int, handle: int, size: int, aligned: int, state: str = "pinned", gpu: str = GPU_A) -> NlPin:
    return NlPin(
        pid=pid,
        file_id=1,
        handle=handle,
        va=0x10000 * handle,
        size=size,
        aligned_va=0x10000 * handle,
        aligned_size=aligned,
        entries=aligned // K64,
        page_size=K64,
        state=state,
        persistent=False,
        created_ns=0,
        user_tag=0,
        gpu_uuid=gpu,
    )


PINS = [
    pin(100, 1, 100, K64),  # 100 bytes hold a whole 64 KiB GPU page
    pin(100, 2, K64 + 1, 2 * K64, gpu=GPU_B),
    pin(100, 3, K64, K64, state="invalidated"),  # its pages went: no BAR1
    pin(200, 1, K64, K64, state="detached"),  # still holds its pages
    pin(300, 1, 4096, 4096, gpu=""),  # a dma-buf pin: no GPU named
]


def sample(stats: dict[str, int] = STATS, mono: float = 10.0, info: dict[str, object] = INFO) -> top.Sample:
    return top.Sample(1_700_000_000.0, mono, dict(info), dict(stats), list(PINS))


def comm(pid: int) -> str:
    return {100: "trainer", 200: "a-very-long-command-name"}.get(pid, "?")


def view(rates: top.Rates | None = None, **kw: object) -> top.View:
    return top.build_view(sample(**kw), rates or top.Rates(), comm)  # type: ignore[arg-type]


def test_bar1_bytes_are_the_aligned_size_while_the_pages_are_held() -> None:
    assert [top.bar1_bytes(p) for p in PINS] == [K64, 2 * K64, 0, K64, 4096]


def test_aggregation_by_process_and_gpu() -> None:
    v = view()
    assert [
        (r.pid, r.comm, r.pins, r.bar1_bytes, r.requested_bytes, r.detached, r.invalidated, r.gpus) for r in v.processes
    ] == [
        (100, "trainer", 3, 3 * K64, 100 + K64 + 1 + K64, 0, 1, 2),
        (200, "a-very-long-command-name", 1, K64, K64, 1, 0, 1),
        (300, "?", 1, 4096, 4096, 0, 0, 1),
    ]
    assert [(g.gpu, g.pins, g.processes, g.bar1_bytes) for g in v.gpus] == [
        (GPU_A, 3, 2, 2 * K64),
        (GPU_B, 1, 1, 2 * K64),
        (None, 1, 1, 4096),
    ]
    assert v.totals == {
        "pins": 5,
        "bar1_bytes": 4 * K64 + 4096,
        "requested_bytes": 100 + K64 + 1 + 2 * K64 + 4096,
        "processes": 3,
        "gpus": 3,
        "detached": 1,
        "invalidated": 1,
    }


def test_rates_from_the_counter_and_the_events() -> None:
    a = sample(mono=10.0)
    b = sample({**STATS, "inval_freed": STATS["inval_freed"] + 6}, mono=12.0)
    r = top.rates_between(a, b, {100: 4}, "subscribed", "x")
    assert r.interval_s == 2.0 and r.invalidations_per_s == 3.0 and r.per_pid == {100: 2.0}
    v = top.build_view(b, r, comm)
    assert [p.invalidations_per_s for p in v.processes] == [2.0, 0.0, 0.0]
    # Without events (no CAP_NET_ADMIN) the per-process rate is unknown, not 0.
    v = top.build_view(b, top.rates_between(a, b, None, "unavailable", "needs CAP_NET_ADMIN"), comm)
    assert [p.invalidations_per_s for p in v.processes] == [None, None, None]
    assert "INVAL/S" in top.PROC_HEADER and top.render(v)[3].endswith("(needs CAP_NET_ADMIN)")


def test_budget_says_which_mechanism_is_in_force() -> None:
    b = top.budget_of(INFO, STATS)
    assert (b.mechanism, b.limit_bytes, b.used_bytes) == ("none", None, 5 * K64)
    assert "no limit in force" in b.detail
    b = top.budget_of({**INFO, "max_pinned_bytes": 1 << 30}, STATS)
    assert (b.mechanism, b.limit_bytes, b.used_bytes) == ("gpupin max_pinned_bytes", 1 << 30, 5 * K64)
    assert "320.0 KiB of 1.0 GiB" in b.detail
    # The per-process share: gpupin's per-file limit without a dmem controller, else dmem.max.
    shares = _budget.Budgets(0, 64 << 20, False, "/user.slice", ())
    b = top.budget_of(INFO, STATS, shares)
    assert (b.mechanism, b.limit_bytes) == ("gpupin max_file_pinned_bytes", None)
    assert b.detail == "64.0 MiB per open file"
    b = top.budget_of({**INFO, "max_pinned_bytes": 1 << 30}, STATS, _budget.Budgets(1 << 30, 0, True, "/a", ()))
    assert b.mechanism == "gpupin max_pinned_bytes + dmem cgroup" and "dmem.max" in b.detail
    b = top.budget_of(INFO, STATS, _budget.Budgets(0, 64 << 20, True, "/a", ()))
    assert b.mechanism == "dmem cgroup + gpupin max_file_pinned_bytes"
    b = top.budget_of(INFO, STATS, _budget.Budgets(0, 0, False, "/", ()))
    assert b.mechanism == "none" and "no dmem controller" in b.detail


def _tree(tmp_path: Path, dmem: str, cgroup: str = "0::/box\n") -> tuple[Path, Path, Path]:
    params, cg = tmp_path / "params", tmp_path / "cgroup"
    params.mkdir(parents=True)
    (params / "dmem").write_text(dmem + "\n")
    (params / "max_pinned_bytes").write_text("0\n")
    (params / "max_file_pinned_bytes").write_text(f"{32 << 20}\n")
    (cg / "box").mkdir(parents=True)
    (cg / "dmem.capacity").write_text("drm/0000:03:00.0/vram0 8589934592\ngpupin/0000:03:00.0/bar1 230686720\n")
    (cg / "box" / "dmem.current").write_text("drm/0000:03:00.0/vram0 0\ngpupin/0000:03:00.0/bar1 4194304\n")
    (cg / "box" / "dmem.max").write_text("drm/0000:03:00.0/vram0 max\ngpupin/0000:03:00.0/bar1 8388608\n")
    proc = tmp_path / "self-cgroup"
    proc.write_text(cgroup)
    return params, cg, proc


def test_budgets_read_from_sysfs_and_the_callers_cgroup(tmp_path: Path) -> None:
    b = _budget.read_budgets(*_tree(tmp_path, "Y"))
    assert (b.dmem, b.cgroup, b.file_max) == (True, "/box", 32 << 20)  # both apply
    # gpupin's own regions only (a DRM driver's VRAM region is not ours to show)
    assert b.regions == (_budget.Region("gpupin/0000:03:00.0/bar1", 230686720, 4 << 20, 8 << 20),)
    text = "\n".join(b.describe())
    assert "cgroup /box" in text and "charged here 4.0 MiB, dmem.max 8.0 MiB" in text
    assert "per file: 32.0 MiB per open file" in text
    b = _budget.read_budgets(*_tree(tmp_path / "n", "N"))
    assert (b.dmem, b.file_max, b.regions) == (False, 32 << 20, ())
    assert "32.0 MiB per open file (max_file_pinned_bytes; EDQUOT)" in "\n".join(b.describe())
    b = _budget.read_budgets(*_tree(tmp_path / "root", "Y", "0::/\n"))  # the root has no dmem.max
    assert b.regions[0].current is None and b.regions[0].limit is None


def test_text_at_100_columns() -> None:
    lines = top.render(view(), 100)
    assert all(len(line) <= 100 for line in lines)
    text = "\n".join(lines)
    assert lines[0].startswith("gpupin top  0.1.0 over nvp2p_sim")
    assert lines[1].startswith("budget: none: no limit in force")
    assert "pinned: 5 pins, 260.0 KiB of BAR1, 3 processes, 3 GPUs" in text
    assert "invalidations: -/s  (freed 2, process exit 1)" in text
    assert lines[4] == (
        "pins 10 unpins 4 dma maps 1  failed: nomem 0 nospc 0 inval 0 quota 0 other 0  callback max 12 us"
    )
    assert top.PROC_HEADER in lines and top.GPU_HEADER in lines
    row = next(line for line in lines if line.lstrip().startswith("100 "))
    assert row.split() == ["100", "trainer", "3", "0", "1", "192.0", "KiB", "128.1", "KiB", "-"]
    assert any(line.startswith("a-very-long-comm") is False and "a-very-long-comm " in line for line in lines)
    assert any(line.startswith(GPU_A) for line in lines) and any(line.startswith("(unnamed") for line in lines)


@pytest.mark.parametrize("width", [40, 60, 80])
def test_narrow_terminals_cut_lines_never_wrap(width: int) -> None:
    wide, narrow = top.render(view(), 200), top.render(view(), width)
    assert len(narrow) == len(wide)  # as many lines: nothing wrapped onto another
    assert all(len(line) <= width for line in narrow)
    assert [line[:width] for line in wide] == narrow


def test_a_short_terminal_drops_the_last_lines_and_says_how_many() -> None:
    full = top.render(view(), 100)
    lines = top.render(view(), 100, height=len(full) - 2)
    assert lines[:-1] == full[: len(full) - 3]
    assert lines[-1] == "... 3 more lines: a taller terminal shows them"
    assert top.render(view(), 100, height=len(full)) == full
    assert len(top.render(view(), 100, height=3)) == 3 and top.render(view(), 100, height=0) == []


def test_no_pins() -> None:
    s = top.Sample(0.0, 0.0, dict(INFO), {**STATS, "bytes_now": 0}, [])
    lines = top.render(top.build_view(s, top.Rates(), comm))
    assert "(no pins)" in lines and top.GPU_HEADER not in lines


def test_json_shape_is_stable() -> None:
    a = sample(mono=1.0)
    b = sample({**STATS, "inval_freed": STATS["inval_freed"] + 1}, mono=2.0)
    d = top.view_json(top.build_view(b, top.rates_between(a, b, {}, "subscribed", "ok"), comm))
    assert json.loads(json.dumps(d)) == d  # plain JSON types only
    assert list(d) == [
        "version",
        "time",
        "interval_s",
        "module",
        "budget",
        "totals",
        "invalidations_per_s",
        "events",
        "events_detail",
        "stats",
        "processes",
        "gpus",
    ]
    assert d["version"] == top.JSON_VERSION == 1
    assert d["module"] == {"version": "0.1.0", "provider": "nvp2p_sim", "abi_version": 2}
    assert d["budget"] == {
        "mechanism": "none",
        "limit_bytes": None,
        "used_bytes": 5 * K64,
        "detail": top.budget_of(INFO, STATS).detail,
    }
    assert set(d["totals"]) == {"pins", "bar1_bytes", "requested_bytes", "processes", "gpus", "detached", "invalidated"}
    assert d["invalidations_per_s"] == 1.0 and d["interval_s"] == 1.0 and d["events"] == "subscribed"
    assert d["stats"] == {**STATS, "inval_freed": STATS["inval_freed"] + 1}
    assert d["processes"][0] == {
        "pid": 100,
        "comm": "trainer",
        "pins": 3,
        "detached": 0,
        "invalidated": 1,
        "bar1_bytes": 3 * K64,
        "requested_bytes": 100 + K64 + 1 + K64,
        "gpus": 2,
        "invalidations_per_s": 0.0,
    }
    assert d["gpus"][-1] == {"gpu": None, "pins": 1, "processes": 1, "bar1_bytes": 4096}


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (1023, "1023 B"), (K64, "64.0 KiB"), (3 << 29, "1.5 GiB")])
def test_human_sizes(n: int, text: str) -> None:
    assert top.human(n) == text


def test_gpu_uuid_text() -> None:
    assert gpu_uuid_text(None) == gpu_uuid_text(bytes(16)) == ""
    assert gpu_uuid_text(bytes(range(16))) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUPIN_HISTORY": os.devnull}
    return subprocess.run(
        [sys.executable, "-m", "gpupin", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def test_without_the_module_it_says_what_to_run() -> None:
    if os.path.isdir("/sys/module/gpupin"):
        pytest.skip("gpupin.ko is loaded on this host")
    for args in (("top", "--once"), ("top", "--once", "--json")):
        r = run(*args)
        assert r.returncode == 1, r
        assert "gpupin module not loaded" in r.stdout and "gpupin load" in r.stdout, r.stdout
    r = run("top")  # stdin is no terminal
    assert r.returncode == 1 and "the live view needs a terminal; use --once" in r.stdout, r.stdout


def test_usage_errors() -> None:
    r = run("top", "--interval", "0")
    assert r.returncode == 1 and "--interval 0.0 is out of range" in r.stdout
    r = run("top", "--once", "--interval", "-1")
    assert r.returncode == 1 and "out of range" in r.stdout


def test_a_limit_and_missing_events_fit_100_columns() -> None:
    """With a budget in force, and events unavailable or lost, the status lines still fit 100
    columns whole (a newcomer's terminal): nothing of the budget or of why is cut."""
    limited = {**INFO, "max_pinned_bytes": 1000 * 1024**3}
    a, b = sample(mono=10.0, info=limited), sample(mono=12.0, info=limited)
    for events, why in (("unavailable", "needs CAP_NET_ADMIN"), ("lost", "some lost: INVAL/S undercounts")):
        lines = top.render(top.build_view(b, top.rates_between(a, b, None, events, why), comm), 1000)
        assert lines[1].startswith("budget: gpupin max_pinned_bytes: ") and lines[1].endswith(
            "(all processes together)"
        )
        assert lines[3].endswith(f"events: {events} ({why})")
        assert all(len(line) <= 100 for line in lines), [line for line in lines if len(line) > 100]
