"""Where a decode step's threads wait: every OpenMP parallel region of a
package's steps timed (bench/omp_regions.c, loaded with LD_PRELOAD), by the
function the region runs.

    python bench/regions.py --package PKG [--sessions 1] [--context 32] [--steps 200]

For each region function: the calls a step makes, the microseconds a call
takes (from the call to its return), the calling thread's own work in it,
how long the calling thread then waits for the last thread to finish
(`caller_waits_us`), and the other threads' mean wait (`others_wait_us`);
the package's functions are named from its compiled code (the method, then
the symbol), others by library and offset. Then the step's totals: its time,
the time its regions take, and the rest (the calling thread alone: the
runtime's host work and whatever the compiled code runs outside regions).

Why: a region's fork and join cost a thread pool a few microseconds, and a
small model's decode step opens a few hundred of them (SmolLM2: 6 a layer).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import cpu_model, emit

HERE = Path(__file__).resolve().parent
PRELOADED = "KVEXPORT_BENCH_REGIONS"  # set in the re-executed process: the shim is loaded


def build_shim(out: Path) -> Path:
    library = out / "omp_regions.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", str(HERE / "omp_regions.c"), "-o", str(library), "-ldl"],
                   check=True)
    return library


def mappings() -> dict[str, tuple[int, str]]:
    """Each mapped file's base address and the /proc path that opens it (a
    package's extracted code is deleted once loaded)."""
    files: dict[str, tuple[int, str]] = {}
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        span, offset, path = parts[0], int(parts[2], 16), parts[5].removesuffix(" (deleted)")
        start = int(span.split("-")[0], 16)
        if offset == 0 and (path not in files or start < files[path][0]):
            files[path] = (start, f"/proc/{os.getpid()}/map_files/{span}")
    return files


def symbols(opener: str) -> list[tuple[int, str]]:
    listing = subprocess.run(["nm", "-C", "--defined-only", opener], capture_output=True, text=True).stdout
    found = []
    for line in listing.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[1] in "tTwW":
            found.append((int(parts[0], 16), parts[2]))
    return sorted(found)


def namer():
    files, tables = mappings(), {}

    def name(address: int) -> str:
        path, (base, opener) = max(((p, b) for p, b in files.items() if b[0] <= address), key=lambda pb: pb[1][0],
                                   default=("?", (0, "")))
        offset = address - base
        method = re.search(r"/([^/]+)\.aoti/", path)
        if not method:
            return f"{Path(path).name}+{offset:#x}"
        if path not in tables:
            tables[path] = symbols(opener)
        exact = [s for a, s in tables[path] if a == offset]
        label = re.sub(r"\(anonymous namespace\)::|\(.*", "", exact[0]) if exact else f"{offset:#x}"
        return f"{method.group(1)}: {label[:90]}"

    return name


def measure(args) -> dict:
    from kvexport.runtime import StepEntry, load

    dump = ctypes.CDLL(None).omp_regions_dump
    dump.argtypes, dump.restype = [ctypes.c_char_p], ctypes.c_int
    runtime = load(args.package)
    live = [runtime.new_session() for _ in range(args.sessions)]
    runtime.step([StepEntry(s, [3 + (i + j) % 256 for j in range(args.context)]) for i, s in enumerate(live)])
    for _ in range(5):
        runtime.step([StepEntry(s, [7]) for s in live])
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "regions.txt"
        dump(str(report).encode())  # the counts restart here
        start = time.perf_counter()
        for _ in range(args.steps):
            runtime.step([StepEntry(s, [7]) for s in live])
        step_us = (time.perf_counter() - start) / args.steps * 1e6
        dump(str(report).encode())
        lines = report.read_text().split("\n")
    name, rows = namer(), []
    for line in filter(None, lines):
        address, calls, region, caller, waits, others = line.split()
        per_step = int(calls) / args.steps
        rows.append({"region": name(int(address, 16)), "calls_per_step": round(per_step, 2),
                     "us_per_call": round(float(region) / 1e3, 2), "caller_work_us": round(float(caller) / 1e3, 2),
                     "caller_waits_us": round(float(waits) / 1e3, 2), "others_wait_us": round(float(others) / 1e3, 2),
                     "us_per_step": round(per_step * float(region) / 1e3, 1)})
    rows.sort(key=lambda r: -r["us_per_step"])
    in_regions = sum(r["us_per_step"] for r in rows)
    return {"cpu": cpu_model(), "package": str(args.package), "sessions": args.sessions, "context": args.context,
            "threads": os.environ.get("OMP_NUM_THREADS", "default"),
            "step_us": round(step_us, 1), "regions_per_step": round(sum(r["calls_per_step"] for r in rows), 1),
            "in_regions_us": round(in_regions, 1), "outside_regions_us": round(step_us - in_regions, 1),
            "caller_waits_us_per_step": round(sum(r["calls_per_step"] * r["caller_waits_us"] for r in rows), 1),
            "regions": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", required=True, type=Path)
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--context", type=int, default=32, help="prompt tokens per session before the timed steps")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    if os.environ.get(PRELOADED):
        emit(measure(args))
        return
    with tempfile.TemporaryDirectory() as scratch:
        shim = build_shim(Path(scratch))
        env = {**os.environ, PRELOADED: "1", "LD_PRELOAD": f"{shim} {os.environ.get('LD_PRELOAD', '')}".strip()}
        sys.exit(subprocess.run([sys.executable, *sys.argv], env=env).returncode)


if __name__ == "__main__":
    main()
