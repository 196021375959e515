"""Export wall time, peak RSS and package size of a whole package.

    python bench/export.py [--model smollm2-135m] [--forward-sizes 1,2,4,8,16,32,64]

Runs `kvexport export` in a child process (a fresh interpreter, as a user
would) and prints JSON from its --report: wall seconds, each step's seconds,
peak RSS (the export's and its compile workers'), per-method trace and
compile seconds, package bytes / weight bytes, the verification line. With
--compare-no-verify, exports again without verification and prints the
ratio of the two wall times.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import emit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--forward-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--max-step-tokens", default="4096")
    parser.add_argument("--max-cells", default="65536")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--backend", default="portable")
    parser.add_argument("--compile-workers", default="0")
    parser.add_argument("--keep", type=Path, help="Write the package here instead of a temporary directory.")
    parser.add_argument("--compare-no-verify", action="store_true",
                        help="Export again with --no-verify and print the wall-time ratio (the cost of verification).")
    args = parser.parse_args()

    first = run_export(args, [])
    result = {"model": args.model, "backend": args.backend, "forward_sizes": args.forward_sizes, **first}
    if args.compare_no_verify:
        unverified = run_export(args, ["--no-verify"])
        result["without_verify_wall_s"] = unverified["wall_s"]
        result["wall_with_verify_over_without"] = round(first["wall_s"] / unverified["wall_s"], 3)
    emit(result)


def run_export(args: argparse.Namespace, extra: list[str]) -> dict:
    """One `kvexport export` in a fresh interpreter, read back from its --report."""
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp) / "pkg"
        report = Path(tmp) / "report.json"
        command = [
            sys.executable, "-m", "kvexport.cli.main", "export", args.model, "-o", str(out), "--overwrite",
            "--use-offgraph-kv-cache", "--forward-sizes", args.forward_sizes,
            "--max-step-tokens", args.max_step_tokens, "--max-cells", args.max_cells, "--dtype", args.dtype,
            "--backend", args.backend, "--compile-workers", args.compile_workers, "--report", str(report), *extra,
        ]
        start = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(f"export failed:\n{proc.stderr}")
        info = json.loads(report.read_text())
        traced = {m: float(s) for m, s in re.findall(r"\] (\S+) traced in ([0-9.]+) s", proc.stderr)}
        compiled = {m: float(s) for m, s in re.findall(r"\] (\S+) compiled in ([0-9.]+) s", proc.stderr)}
        steps = {row["step"]: row["seconds"] for row in info["steps"]}
        return {
            "wall_s": round(wall, 1),
            "steps_s": steps,
            "peak_rss_mb": max(row["peak_rss_mb"] for row in info["steps"]),
            "peak_rss_compile_workers_mb": max(row["peak_rss_children_mb"] for row in info["steps"]),
            "trace_s_per_method": traced,
            "trace_s_total": round(sum(traced.values()), 1),
            "compile_s_per_method": compiled,
            "methods": len(info["methods"]),
            "wall_over_trace": round(wall / sum(traced.values()), 2) if traced else None,
            **info["sizes"],
            "verification": info["verification"],
        }


if __name__ == "__main__":
    main()
