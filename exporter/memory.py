"""What an export holds in memory: the plan checked against `--max-memory`
before any work, and the peak it reached, measured.

Memory here is private memory (anonymous RSS), of the export and its
compile workers together. A checkpoint in the export's dtype is mapped, not
copied: its pages are the file's, read on demand and dropped by the kernel
when memory is short, so they count in RSS but do not bound the model's
size. Both figures are reported."""

from __future__ import annotations

import functools
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kvexport.contract.errors import SpecError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """'4GB', '4 GiB', '512MB', '2.5G' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise SpecError(f"--max-memory {text!r}: expected a size like 4GB, 512MB or 2.5GiB")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:
        raise SpecError(f"--max-memory {text!r}: must be above zero")
    return value


# measured here (bench/big_model.py, SmolLM2 and Llama 3.2 1B shapes): the
# interpreter with torch and transformers, the traced graphs and the reference
# run's activations stayed under this
BASE_BYTES = 1 << 30
COMPILE_WORKER_BYTES = 600 << 20  # an AOTInductor worker compiling around stand-ins


@dataclass
class MemoryPlan:
    items: list[tuple[str, int]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(n for _, n in self.items)

    def describe(self) -> str:
        return ", ".join(f"{what} {n / 1e9:.2f} GB" for what, n in self.items if n)


def plan_memory(*, private_weights: int, quantized_bytes: int, compile_workers: int) -> MemoryPlan:
    """The private memory an export needs: the base, the weights loading
    holds privately (mapped ones count nothing), quantized copies, and the
    compile workers."""
    plan = MemoryPlan([("interpreter, graphs and activations", BASE_BYTES)])
    if private_weights:
        plan.items.append(("weights held in memory", private_weights))
    if quantized_bytes:
        plan.items.append(("quantized weights", quantized_bytes))
    if compile_workers:
        plan.items.append((f"{compile_workers} compile worker(s)", compile_workers * COMPILE_WORKER_BYTES))
    return plan


def check_budget(plan: MemoryPlan, budget: int, hints: list[str]) -> None:
    if plan.total > budget:
        fixes = "; ".join(hints) if hints else "raise --max-memory"
        raise SpecError(
            f"--max-memory {budget / 1e9:.2f} GB: this export needs about {plan.total / 1e9:.2f} GB of private memory "
            f"({plan.describe()}). {fixes}"
        )


def private_memory_mb(root: int | None = None) -> tuple[float, float]:
    """(RSS, anonymous RSS) in MB of a process and all its descendants
    (Linux; (0, 0) elsewhere)."""
    root = os.getpid() if root is None else root
    if not os.path.exists(f"/proc/{root}/status"):
        return 0.0, 0.0
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    rss = anon = 0
    todo = [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(re.findall(r"^(\w+):\s+(\d+) kB", f.read(), re.M))
        except OSError:
            continue
        rss += int(fields.get("VmRSS", 0))
        anon += int(fields.get("RssAnon", 0))
    return rss / 1024, anon / 1024


class PeakSampler:
    """Samples this process tree's RSS and private memory every `interval`
    seconds in a thread; `take()` returns the peaks since the last take."""

    def __init__(self, interval: float = 0.2):
        self.interval = interval
        self.peak = [0.0, 0.0]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvexport-memory")

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        rss, anon = private_memory_mb()
        with self._lock:
            self.peak = [max(self.peak[0], rss), max(self.peak[1], anon)]

    def take(self) -> dict[str, float]:
        self.sample()
        with self._lock:
            rss, anon = self.peak
            self.peak = [0.0, 0.0]
        return {"peak_tree_rss_mb": round(rss, 1), "peak_tree_private_mb": round(anon, 1)}


def release_freed_memory() -> None:
    """Hands memory freed inside this process back to the system (glibc's
    malloc_trim; nothing elsewhere). glibc keeps freed blocks of tens of MB
    for reuse, so a loop of large temporaries (quantizing layer after
    layer) would otherwise hold its largest total, not its largest step."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
