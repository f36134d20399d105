"""The package's layers: the library never imports test support, and of the tools only the
bench does (it times the fakes); the demo and the self-test, which users run, use the library's
own gpupin.peer.  Read from the sources (imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "pyctl" / "gpupin"
MAY_IMPORT_TESTING = {"tools/bench.py"}


def _imports_testing(path: Path) -> list[int]:
    """Lines of ``path`` that import gpupin.testing (absolutely or relatively)."""
    rel = path.relative_to(PKG)
    depth = len(rel.parts) - 1  # packages between gpupin and the file
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names = [node.module or ""]
            elif node.level == depth + 1:  # relative to gpupin itself
                names = [f"gpupin.{node.module}" if node.module else f"gpupin.{a.name}" for a in node.names]
            else:
                continue
        else:
            continue
        if any(n == "gpupin.testing" or n.startswith("gpupin.testing.") for n in names):
            lines.append(node.lineno)
    return lines


def test_the_library_and_the_tools_users_run_import_no_test_support() -> None:
    files = [p for p in PKG.rglob("*.py") if "testing" not in p.relative_to(PKG).parts]
    assert any(p.name == "demo.py" for p in files) and any(p.name == "selftest.py" for p in files)
    bad = {
        str(p.relative_to(PKG)): lines
        for p in files
        if str(p.relative_to(PKG)) not in MAY_IMPORT_TESTING and (lines := _imports_testing(p))
    }
    assert not bad, f"modules importing gpupin.testing (file: lines): {bad}"
    assert _imports_testing(PKG / "tools" / "bench.py"), "the check sees no import where one is"
