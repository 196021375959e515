"""`kvexport validate`: checks a package without running it. Programs are
read as JSON; nothing is rebuilt, compiled or unpickled."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

from kvexport.runtime.errors import PackageError
from kvexport.runtime.loader import select_io_manager
from kvexport.runtime.package import PackageReader
from kvexport.runtime.step_width import GraphView, StepWidthError, check_step_width, view_of_serialized


@dataclass
class Report:
    path: str
    violations: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        if self.ok:
            return f"{self.path}: ok ({', '.join(self.checked)})"
        return f"{self.path}: {len(self.violations)} violation(s)"


def validate_package(path: str | Path) -> Report:
    report = Report(str(path))
    try:
        reader = PackageReader(path)
        manager = select_io_manager(reader.manifest)
    except PackageError as e:
        report.violations.append(str(e))
        return report
    manifest = reader.manifest
    contract = manifest["contract"]
    contract_problems = manager.check_manifest(manifest)
    report.violations += contract_problems
    report.checked.append(f"{contract['name']} v{contract['version']} schema")
    report.violations += reader.verify_checksums()
    report.checked.append(f"{len(manifest['files'])} checksums")
    if contract_problems:
        return report  # the programs cannot be compared with an invalid manifest
    for name, entry in manifest["methods"].items():
        try:
            program = json.loads(gzip.decompress((reader.path / entry["program"]).read_bytes()))
        except (OSError, ValueError) as e:
            report.violations.append(f"methods.{name}.program: cannot read {entry['program']} ({e})")
            continue
        view = view_of_serialized(program)
        report.violations += check_program_io(name, entry, program, view)
        if "step_width" in entry:
            try:
                check_step_width(entry["step_width"], view)
            except StepWidthError as e:
                report.violations.append(f"methods.{name}.step_width: {e}")
    report.checked.append(f"{len(manifest['methods'])} programs against their specs and step widths")
    return report


def check_program_io(method: str, entry: dict, program: dict, view: GraphView) -> list[str]:
    """The stored graph's user inputs and outputs against the manifest's
    specs: count, dtype, rank, static sizes and dynamic ranges."""
    graph = program["graph_module"]
    ranges = {k: (v.get("min_val"), v.get("max_val")) for k, v in program.get("range_constraints", {}).items()}
    outputs = [
        spec["user_output"]["arg"]["as_tensor"]["name"]
        for spec in graph["signature"]["output_specs"]
        if "user_output" in spec and "as_tensor" in spec["user_output"]["arg"]
    ]
    problems = []
    for side, names, specs in (("inputs", view.user_inputs, entry["inputs"]), ("outputs", outputs, entry["outputs"])):
        if len(names) != len(specs):
            problems.append(f"methods.{method}.{side}: the program has {len(names)}, the manifest lists {len(specs)}")
            continue
        for i, (value, spec) in enumerate(zip(names, specs)):
            where = f"methods.{method}.{side}[{i}] ({spec['name']})"
            dtype, shape = view.dtypes.get(value), view.shapes.get(value, ())
            if dtype != spec["dtype"]:
                problems.append(f"{where}: the program's dtype is {dtype}, the manifest says {spec['dtype']}")
            if len(shape) != len(spec["shape"]):
                problems.append(f"{where}: the program's rank is {len(shape)}, the manifest says {len(spec['shape'])}")
                continue
            for d, (size, want) in enumerate(zip(shape, spec["shape"])):
                if isinstance(want, int) and size != want:
                    problems.append(f"{where}: dim {d} is {size} in the program, the manifest says {want}")
                elif isinstance(want, dict):
                    if isinstance(size, int):
                        problems.append(f"{where}: dim {d} is static {size} in the program, the manifest says dynamic {want['name']}")
                    elif size in ranges and ranges[size] != (want["min"], want["max"]):
                        lo, hi = ranges[size]
                        problems.append(
                            f"{where}: dim {d} ranges over {lo}..{hi} in the program, the manifest says {want['min']}..{want['max']}"
                        )
    return problems


def render(report: Report) -> str:
    if report.ok:
        return report.summary()
    return report.summary() + "\n" + "\n".join(f"  - {v}" for v in report.violations)

