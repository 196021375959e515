"""Export wall time, peak RSS and package size of a whole package.

    python bench/export.py [--model smollm2-135m] [--forward-sizes 1,2,4,8,16,32,64]

Runs `kvexport export` in a child process (a fresh interpreter, as a user
would) and prints JSON: wall seconds, the child's peak RSS, per-method trace
seconds, package bytes / weight bytes.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
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
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp) / "pkg"
        command = [
            sys.executable, "-m", "kvexport.cli.main", "export", args.model, "-o", str(out), "--overwrite",
            "--use-offgraph-kv-cache", "--forward-sizes", args.forward_sizes,
            "--max-step-tokens", args.max_step_tokens, "--max-cells", args.max_cells, "--dtype", args.dtype,
            "--backend", args.backend, "--compile-workers", args.compile_workers,
        ]
        start = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(f"export failed:\n{proc.stderr}")
        peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        manifest = json.loads((out / "manifest.json").read_text())
        files = manifest["files"]
        package_bytes = sum(f["bytes"] for f in files.values()) + (out / "manifest.json").stat().st_size
        weights_bytes = files[manifest["weights"]["file"]]["bytes"]
        traced = {m: float(s) for m, s in re.findall(r"\] (\S+) traced in ([0-9.]+) s", proc.stderr)}
        steps = {k: float(v) for k, v in re.findall(r"^(caller's passes|backend passes|partition, lower and check|reserve constant names|write \S+): ([0-9.]+) s$", proc.stderr, re.M)}
        steps = {("write" if k.startswith("write") else k): v for k, v in steps.items()}
        compiled = {m: float(s) for m, s in re.findall(r"\] (\S+) compiled in ([0-9.]+) s", proc.stderr)}
        compile_wall = re.findall(r"compiled \d+ methods in ([0-9.]+) s with (\d+) worker", proc.stderr)
        passes_s = sum(v for k, v in steps.items() if k != "write")
        emit({
            "model": args.model,
            "backend": args.backend,
            "compile_s_per_method": compiled,
            "compile_wall_s": float(compile_wall[0][0]) if compile_wall else None,
            "compile_workers": int(compile_wall[0][1]) if compile_wall else None,
            "forward_sizes": args.forward_sizes,
            "methods": len(manifest["methods"]),
            "wall_s": round(wall, 1),
            "peak_rss_mb": round(peak_kb / 1024, 1),
            "trace_s_per_method": traced,
            "trace_s_total": round(sum(traced.values()), 1),
            "pipeline_steps_s": steps,
            "passes_and_checks_s": round(passes_s, 2),
            "wall_over_trace": round(wall / sum(traced.values()), 2),
            "package_bytes": package_bytes,
            "weights_bytes": weights_bytes,
            "package_over_weights": round(package_bytes / weights_bytes, 4),
        })


if __name__ == "__main__":
    main()
