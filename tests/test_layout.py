"""The rooms of kvexport and which part may import which, read from the source (imports
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


def string_constants(path: Path) -> list[tuple[str, int]]:
    """Every string literal of the file that is not a docstring."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value) for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    return [(node.value, node.lineno) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_nothing_outside_a_backends_folder_says_its_name():
    """A backend is its folder: no core module switches on a backend's id
    (the default backend is named once, in the contract)."""
    from kvexport.contract.manifest import DEFAULT_BACKEND
    from kvexport.partitioners.registry import backend_ids

    ids = set(backend_ids())
    assert {"portable", "aoti"} <= ids
    said = []
    for part in PARTS:
        for path in sorted((ROOT / part).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.parts[0] == "partitioners" and len(rel.parts) > 2 and rel.parts[1] in ids:
                continue  # the backend's own folder
            for value, line in string_constants(path):
                if value in ids and not (rel.as_posix() == "contract/manifest.py" and value == DEFAULT_BACKEND):
                    said.append(f"{rel}:{line} says {value!r}")
    assert not said, "only a backend's own folder may name it:\n" + "\n".join(said)


def test_each_backend_is_a_folder_that_registers_itself():
    from kvexport.partitioners.registry import backend_ids

    folders = {p.name for p in (ROOT / "partitioners").iterdir() if (p / "__init__.py").is_file()}
    assert set(backend_ids()) <= folders | {"mine"}  # tests may register one from outside


def test_the_exporter_holds_the_pipeline_and_its_rooms():
    """exporter/ is the pipeline; model sources and quantization are rooms of
    their own, and the aoti backend's code lives in its folder."""
    top = {p.name for p in (ROOT / "exporter").glob("*.py")}
    assert {"pipeline.py", "spec.py", "plan.py", "forwards.py"} <= top
    assert not top & {"models.py", "quantize.py", "aoti_compile.py", "row_kernel.py", "backends.py"}
    assert (ROOT / "exporter" / "sources" / "models.py").is_file()
    assert (ROOT / "exporter" / "quantization" / "quantize.py").is_file()
    assert not list((ROOT / "exporter").glob("*.cpp")) and list((ROOT / "partitioners" / "aoti" / "kernels").glob("*.cpp"))


def test_every_code_folder_is_an_installed_package():
    """pyproject.toml lists the packages one by one (the folders are mapped
    into kvexport.*): a folder missing there works from a checkout and is
    absent from an install."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {
        "kvexport." + ".".join(init.parent.relative_to(ROOT).parts)
        for part in PARTS for init in (ROOT / part).rglob("__init__.py") if "__pycache__" not in init.parts
    }
    assert folders == listed, f"add to pyproject.toml: {sorted(folders - listed)}; no such folder: {sorted(listed - folders)}"
