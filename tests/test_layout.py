"""Which part of kvexport may import which, read from the source (imports
inside functions included): the contract leans on nothing of ours; the
exporter, passes and partitioners lean on the contract, never on the
runtime; the runtime never on the exporter; nothing but the CLI imports the
CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("contract", "exporter", "passes", "partitioners", "runtime", "cli", "configs")
MAY_IMPORT = {
    "contract": set(),
    "passes": {"contract"},
    "partitioners": {"contract", "passes"},
    "exporter": {"contract", "passes", "partitioners", "configs"},
    "runtime": {"contract"},
    "cli": {"contract", "exporter", "passes", "partitioners", "runtime", "configs"},
    "configs": set(),
}


def imported_parts(path: Path) -> dict[str, int]:
    """kvexport part -> the first line importing it, for every import in the file."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "kvexport" and len(parts) > 1 and parts[1] in PARTS:
                found.setdefault(parts[1], node.lineno)
            elif parts[0] in PARTS and parts[0] != "configs":
                found.setdefault(f"flat {parts[0]}", node.lineno)
    return found


def test_every_part_is_a_package():
    for part in PARTS:
        assert (ROOT / part / "__init__.py").is_file(), part


@pytest.mark.parametrize("part", PARTS)
def test_imports_follow_the_rules(part):
    broken = []
    for path in sorted((ROOT / part).rglob("*.py")):
        for imported, line in imported_parts(path).items():
            if imported.startswith("flat "):
                broken.append(f"{path.relative_to(ROOT)}:{line} imports {imported[5:]} flat; use kvexport.{imported[5:]}")
            elif imported != part and imported not in MAY_IMPORT[part]:
                broken.append(f"{path.relative_to(ROOT)}:{line} imports kvexport.{imported}")
    assert not broken, f"{part} may import only {sorted(MAY_IMPORT[part]) or 'nothing of ours'}:\n" + "\n".join(broken)


def test_the_rule_reader_sees_lazy_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from kvexport.runtime import load\n    import kvexport.cli.main\n")
    assert imported_parts(source) == {"runtime": 2, "cli": 3}
