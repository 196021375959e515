"""Resident memory of a loaded package: every method bound to one copy of the
weights. Loads the package in a fresh process, runs 1 method, then all of
them, and reports RSS growth against the weights' bytes. Then starts
`--processes` runtimes of the package at once (each touches every weight)
and reports each one's private and shared memory and the machine's
MemAvailable drop while they all hold it: the weights are mapped from the
file, so the processes share one copy in the page cache.

    python bench/memory.py --package PKG [--processes 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import emit
from kvexport.contract.confined_io import available_memory

CHILD = r"""
import json, resource, sys, torch
from kvexport.runtime import load, StepEntry

def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

path, count = sys.argv[1], int(sys.argv[2])
base = rss_mb()
rt = load(path)
loaded = rss_mb()
forwards = sorted((m for m in rt.package.manifest["methods"] if m.startswith("forward_") and m != "forward_others"),
                  key=lambda m: int(m.split("_")[1]))[:count]
for name in forwards:
    n = int(name.split("_")[1])
    s = rt.new_session()
    rt.step([StepEntry(s, list(range(3, 3 + n)))])
    rt.release(s)
print(json.dumps({"methods_run": forwards, "rss_after_load_mb": round(loaded - base, 1), "rss_after_run_mb": round(rss_mb() - base, 1)}))
"""


HOLDER = r"""
import re, sys, time
from kvexport.runtime import load
rt = load(sys.argv[1], trust_native_code=True)
total = sum(float(t.float().sum()) for t in rt.package.tensors.values())  # touch every page
fields = dict(re.findall(r"^(\w+):\s+(\d+) kB", open("/proc/self/smaps_rollup").read(), re.M))
print({k: int(fields[k]) // 1024 for k in ("Rss", "Private_Dirty", "Private_Clean", "Shared_Clean")}, flush=True)
sys.stdin.read()  # hold until the parent has measured
"""


def mem_available_mb() -> int:
    available = available_memory()
    if available is None:
        raise RuntimeError("no MemAvailable in /proc/meminfo")
    return available // 2**20


def shared_processes(package: Path, count: int) -> dict:
    before = mem_available_mb()
    children = [subprocess.Popen([sys.executable, "-c", HOLDER, str(package)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(count)]
    try:
        each = [child.stdout.readline().strip() for child in children]
        drop = before - mem_available_mb()
    finally:
        for child in children:
            child.stdin.close()
            child.wait()
    return {"processes": count, "memory_mb_each": each, "mem_available_drop_mb": drop}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--package", required=True, type=Path)
    parser.add_argument("--processes", type=int, default=3)
    args = parser.parse_args()
    manifest = json.loads((args.package / "manifest.json").read_text())
    weights_mb = manifest["files"][manifest["weights"]["file"]]["bytes"] / 2**20
    runs = {}
    for count in (1, 8):
        out = subprocess.run([sys.executable, "-c", CHILD, str(args.package), str(count)], capture_output=True, text=True, check=True)
        runs[count] = json.loads(out.stdout.strip().splitlines()[-1])
    emit({
        "package": str(args.package),
        "backend": manifest.get("backend", {}).get("id", "portable"),
        "weights_mb": round(weights_mb, 1),
        "one_method": runs[1],
        "all_static_methods": runs[8],
        "extra_rss_for_more_methods_mb": round(runs[8]["rss_after_run_mb"] - runs[1]["rss_after_run_mb"], 1),
        "shared": shared_processes(args.package, args.processes) if args.processes > 1 else None,
    })


if __name__ == "__main__":
    main()
