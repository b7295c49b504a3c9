"""The packages form layers: decode (the runtime) < hwprofile (the profiler) < supernet (training) < nas (search).

A lower layer never imports a higher one, so the runtime and the profiler can be used (and shipped)
without the training and search code. Checked on the import statements of every module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["decode", "hwprofile", "supernet", "nas"]


def imported_packages(path: Path) -> set[str]:
    """Top-level packages named by the import statements anywhere in the module (lazy imports too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", ORDER[:-1])
def test_a_lower_layer_never_imports_a_higher_one(package):
    higher = set(ORDER[ORDER.index(package) + 1:])
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    bad = {str(f.relative_to(ROOT)): sorted(imported_packages(f) & higher) for f in files}
    assert not {f: p for f, p in bad.items() if p}


def test_the_checker_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from nas.search import run_search\n    import supernet.train\n")
    assert {"nas", "supernet"} <= imported_packages(module)
