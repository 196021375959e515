"""Packages are untrusted input: the operator fuzzer. Where
test_fuzz_packages.py mutates a package's structure, this mutates what runs:
a node's target swapped for another registered aten or prims overload
(most are refused by the allowlist; a swap to a listed one reaches the
kernel with arguments meant for another), or an argument set to an edge
value (huge, negative, zero, NaN, infinite). A kernel that trusts its
arguments can crash the process, so each batch of cases runs in a child
process under a memory cap and a time limit, and the child reports each
case before it starts: a signal names its case.

    KVEXPORT_OPFUZZ_CASES=500 KVEXPORT_FUZZ_SEED=7 pytest tests/test_fuzz_operators.py -o log_cli=true
    KVEXPORT_FUZZ_CASE=123 ...   # replays one case of that seed
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import os
import random
import shutil
import sys
from collections import Counter
from pathlib import Path

from test_fuzz_packages import ONLY, SEED, dumps, exercise, fix_checksums

log = logging.getLogger(__name__)

OP_CASES = int(os.environ.get("KVEXPORT_OPFUZZ_CASES", "8"))
OP_BATCH = 50
OP_MEMORY = 8 << 30  # address space of a child; the tiny package needs about 3 GiB of it
OP_SECONDS_PER_CASE = 60
EDGE_INTS = [0, -1, 1, -(2**31), 2**31, 2**62, -(2**62), 2**63 - 1, 10**12, 65536]
EDGE_FLOATS = [math.nan, math.inf, -math.inf, 1e308, -0.0, 1e-45]


def registered_overloads() -> list[str]:
    """Every aten and prims overload this torch registers, as node targets."""
    import torch

    names = []
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, rest = qualified.partition("::")
        op, _, overload = rest.partition(".")
        if namespace in ("aten", "prims"):
            names.append(f"torch.ops.{namespace}.{op}.{overload or 'default'}")
    return sorted(names)


def _edge(arg: dict, rng: random.Random) -> str | None:
    """Sets one literal of a serialized argument to an edge value."""
    if "as_int" in arg:
        arg["as_int"] = rng.choice(EDGE_INTS)
        return f"as_int {arg['as_int']}"
    if "as_float" in arg:
        arg["as_float"] = rng.choice(EDGE_FLOATS)
        return f"as_float {arg['as_float']}"
    if arg.get("as_ints"):
        i = rng.randrange(len(arg["as_ints"]))
        arg["as_ints"][i] = rng.choice(EDGE_INTS)
        return f"as_ints[{i}] {arg['as_ints'][i]}"
    if arg.get("as_sym_ints"):
        i = rng.randrange(len(arg["as_sym_ints"]))
        arg["as_sym_ints"][i] = {"as_int": rng.choice(EDGE_INTS)}
        return f"as_sym_ints[{i}] {arg['as_sym_ints'][i]['as_int']}"
    if "as_scalar_type" in arg:
        arg["as_scalar_type"] = rng.choice([0, 1, 5, 9, 12, 13, 29, 35, 99])
        return f"as_scalar_type {arg['as_scalar_type']}"
    return None


def mutate_operator(program: dict, rng: random.Random, overloads: list[str], allowed: list[str]) -> str:
    """One operator mutation of a program; returns what was done."""
    nodes = program["graph_module"]["graph"]["nodes"]
    node = rng.choice(nodes)
    if rng.random() < 0.5:
        node["target"] = rng.choice(overloads if rng.random() < 0.6 else allowed)
        return f"{node['name']} -> {node['target']}"
    literals = [entry for entry in node["inputs"] if isinstance(entry.get("arg"), dict)]
    for entry in rng.sample(literals, len(literals)):
        note = _edge(entry["arg"], rng)
        if note is not None:
            return f"{node['name']} ({node['target']}) {entry['name']} = {note}"
    return f"{node['name']}: no literal argument"


def run_operator_cases(source: Path, work: Path, seed: int, cases: list[int]) -> None:
    """The child: each case prints `start N` first, then one JSON line."""
    from kvexport.contract.op_allowlist import ALLOWED_OPS

    overloads, allowed = registered_overloads(), sorted(ALLOWED_OPS)
    methods = sorted(p.name.removesuffix(".json.gz") for p in (source / "programs").glob("*.json.gz"))
    for case in cases:
        print(f"start {case}", flush=True)
        rng = random.Random(f"{seed}:op:{case}")
        pkg = work / f"op{case}"
        shutil.copytree(source, pkg)
        method = rng.choice(methods)
        path = pkg / "programs" / f"{method}.json.gz"
        program = json.loads(gzip.decompress(path.read_bytes()))
        notes = [mutate_operator(program, rng, overloads, allowed) for _ in range(rng.choice([1, 1, 2]))]
        path.write_bytes(gzip.compress(dumps(program), mtime=0))
        fix_checksums(pkg)
        reached = Counter()
        problems = exercise(pkg, method, reached)
        print(json.dumps({"case": case, "method": method, "notes": notes, "problems": problems,
                          "reached": dict(reached)}), flush=True)
        shutil.rmtree(pkg, ignore_errors=True)


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (OP_MEMORY, OP_MEMORY))


def run_operator_batch(source: Path, work: Path, seed: int, cases: list[int]) -> tuple[list[dict], list[str]]:
    """Runs cases in a child until all ran; a crash or a hang is the
    failure of the case that was running, and the rest go on."""
    import subprocess

    results, failures = [], []
    while cases:
        command = [sys.executable, __file__, "operator-cases", str(source), str(work), str(seed), *map(str, cases)]
        try:
            child = subprocess.run(command, capture_output=True, text=True, preexec_fn=_limit_memory,
                                   timeout=OP_SECONDS_PER_CASE * len(cases) + 30)
            output, ended = child.stdout, f"exit {child.returncode}" + (f" (signal {-child.returncode})" if child.returncode < 0 else "")
        except subprocess.TimeoutExpired as e:
            output, ended = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timed out"
        started = None
        for line in output.splitlines():
            if line.startswith("start "):
                started = int(line.split()[1])
            elif line.startswith("{"):
                results.append(json.loads(line))
                started = None
        done = {r["case"] for r in results}
        if started is not None:
            failures.append(f"operator case {started} (seed {seed}): the child {ended} while running it")
            done.add(started)
        elif set(cases) - done:  # the child died before its first case: not a finding, a broken harness
            raise AssertionError(f"the operator fuzz child {ended} before any case:\n{child.stderr[-2000:]}")
        cases = [c for c in cases if c not in done]
    return results, failures


def test_swapped_operators_and_edge_arguments_never_crash(tmp_path, tiny_package):
    """Each case must end in a clear refusal (validate lists it, load or a
    rebuild raises a KvexportError) or a correct run, within its memory and
    time cap, in a child that never dies of a signal."""
    cases = [int(ONLY)] if ONLY is not None else list(range(OP_CASES))
    source = tiny_package("tiny-llama")
    results, failures, reached = [], [], Counter()
    for start in range(0, len(cases), OP_BATCH):
        batch_results, batch_failures = run_operator_batch(source, tmp_path, SEED, cases[start : start + OP_BATCH])
        results += batch_results
        failures += batch_failures
    for result in results:
        reached.update(result["reached"])
        if result["problems"]:
            failures.append(f"operator case {result['case']} ({result['method']}: {'; '.join(result['notes'])}):\n  "
                            + "\n  ".join(result["problems"]))
    summary = f"{len(cases)} operator cases (seed {SEED}): " + ", ".join(f"{k} {v}" for k, v in sorted(reached.items()))
    log.warning(summary)
    assert not failures, f"{summary}; {len(failures)} failed (replay one with KVEXPORT_FUZZ_CASE=N):\n" + "\n".join(failures[:30])


if __name__ == "__main__" and sys.argv[1:2] == ["operator-cases"]:
    logging.disable(logging.WARNING)
    run_operator_cases(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), [int(c) for c in sys.argv[5:]])
