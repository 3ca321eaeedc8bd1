"""Who may import whom: the library (``pipeline/``, ``calibration/``) stands alone — no Prefect,
no flows, no benchmarks, no CLI — so it can be used from a notebook, and ``pipeline/merge`` stands
apart from the data, model and training code (the model families' declarations excepted), so it
can be used as a merge tool by itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth of its code (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in sorted(imports(path))
        if name.split(".")[0] in forbidden or any(name.startswith(f + ".") or name == f for f in forbidden)
    ]


@pytest.mark.parametrize("package", ["pipeline", "calibration"])
def test_the_library_imports_no_flow_benchmark_cli_or_prefect(package):
    assert offenders(package, ("flows", "benchmarks", "merit", "prefect")) == []


def test_the_merge_library_imports_no_data_model_or_training_code():
    forbidden = (
        "pipeline.data",
        "pipeline.models",
        "pipeline.train",
        "pipeline.diloco",
        "pipeline.eval",
        "calibration",
    )
    # The model families' declarations (names: groups, fused experts) are the one exception, and
    # they import no model code themselves (transformers only inside their tiny-model builders).
    families = "pipeline.models.families"
    found = [o for o in offenders("pipeline/merge", forbidden) if not o.endswith(f"imports {families}")]
    assert found == []
    module_level = {
        name
        for path in (ROOT / families.replace(".", "/")).glob("*.py")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ImportFrom | ast.Import)
        for name in ([node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names])
    }
    assert {n for n in module_level if n.split(".")[0] in ("torch", "transformers", "peft")} == set()
