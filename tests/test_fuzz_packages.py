"""Packages are untrusted input: a seeded fuzzer. Each case copies a tiny
package (offgraph_kv, ingraph_kv or hf_static), mutates its manifest, one of
its programs or its weights file's header (types, numbers, strings, nesting,
deleted keys, truncated bytes, values swapped for others of their type, code
aimed at the names torch writes into Python), fixes the checksums up as an
attacker would, so the mutation reaches the deep checks, and then:

- `validate_package` returns a Report, never raises;
- `describe` (and its rendering, as `kvexport inspect` shows it) returns
  or raises a KvexportError;
- `load`, rebuilding the methods and a short `generate` work or raise a
  KvexportError: anything else is what the CLI calls an internal error;
- no injected code runs (the canary file is never created);
- each case finishes within CASE_SECONDS.

    KVEXPORT_FUZZ_CASES=2000 KVEXPORT_FUZZ_SEED=7 pytest tests/test_fuzz_packages.py -p no:logging
    KVEXPORT_FUZZ_CASE=123 ...   # replays one case of that seed
"""

from __future__ import annotations

import copy
import gzip
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import struct
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import pytest

from helpers import export_tiny
from kvexport.runtime import generate, load
from kvexport.contract.errors import KvexportError
from kvexport.contract.inspect import describe, render as render_info
from kvexport.contract.package import confined_problem, sha256_file
from kvexport.contract.sampler import SamplingConfig
from kvexport.contract.validate import Report, render as render_report, validate_package

log = logging.getLogger(__name__)

CASES = int(os.environ.get("KVEXPORT_FUZZ_CASES", "150"))  # about 30 s, and 15 s to export the packages
SEED = int(os.environ.get("KVEXPORT_FUZZ_SEED", "20240611"))
ONLY = os.environ.get("KVEXPORT_FUZZ_CASE")
CASE_SECONDS = 20.0
HANG_SECONDS = 120  # a case still running then is stopped and reported as a hang
CANARY = "kvexport-fuzz-canary"


# ------------------------------------------------------------------ values
CANARY_MODULE = "kvexport_fuzz_canary"  # importing it creates the canary file


def injections(canary: Path) -> list[str]:
    """Python that creates the canary, shaped for the places a name or an
    expression could land in generated source, and a JSON object torch's
    pytree decoder would import a module for."""
    touch = f"__import__('os').system('touch {canary}')"
    return [
        touch, f"x={touch}", f"x':{touch},'y", f"x):\n    {touch}\n    def _(y", f"Mul(Integer(16), {touch})",
        f"Symbol('s1', positive={touch})", json.dumps({"__enum__": True, "fqn": f"{CANARY_MODULE}:X", "name": "a"}),
        json.dumps([json.dumps({"__enum__": True, "fqn": f"{CANARY_MODULE}:X", "name": "a"})]),
    ]


def interesting_strings(canary: Path) -> list[str]:
    return injections(canary) + [
        "", "../..", "../../etc/passwd", "/etc/passwd", "programs/../manifest.json", "programs", "a\\b", ".",
        "a" * 100_000, "ü∂😀\u202e", "\ud800", "nul\x00byte", "s27", "C", "1:0", "0:1", "99:0", "1:99", "1:0:0",
        "Symbol('s99', positive=True, integer=True)",
        "Integer(9223372036854775808)", "FloorDiv(Symbol('s1'), Integer(0))", "Max(" * 500 + "Integer(1)" + ")" * 500,
        "torch.ops.aten.from_file.default", "torch.ops.aten.mm.default", "torch.ops.aten.mm", "builtins.eval",
        "_operator.getitem", "torch.sym_max", "programs/forward_1.json.gz", "weights.safetensors", "manifest.json",
        "forward_1", "forward_0", "forward_others", "sample", "offgraph_kv", "ingraph_kv", "hf_static", "aoti",
        "portable", "fp32", "bf16", "float16", "int64", "bool", "kv_k", "kv.0.k", "decoder.embed_tokens.weight",
    ]


NUMBERS = [0, -1, 1, 2, 3, 7, 2**31, 2**62, 2**63, -(2**63), 2**64, 10**30, 10**400, 0.5, -0.0, 1.0, 1e308,
           math.nan, math.inf, -math.inf, True, False]


def nested(depth: int, rng: random.Random) -> str:
    """A placeholder that `dumps` writes as `depth` levels of nesting:
    deeper than json.dumps itself could write."""
    return f"{NEST}{depth}:{rng.choice('[{')}"


NEST = "\x00nest:"


def dumps(doc) -> bytes:
    text = json.dumps(doc, allow_nan=True)
    return re.sub(r'"\\u0000nest:(\d+):(.)"', lambda m: _deep(int(m[1]), m[2]), text).encode()


def _deep(depth: int, bracket: str) -> str:
    if bracket == "[":
        return "[" * depth + "1" + "]" * depth
    return '{"x": ' * depth + "1" + "}" * depth


def random_value(rng: random.Random, canary: Path):
    kind = rng.random()
    if kind < 0.4:
        return rng.choice(NUMBERS)
    if kind < 0.75:
        return rng.choice(interesting_strings(canary))
    return rng.choice([None, [], {}, [1, 2], {"name": "T", "min": 1, "max": 2}, {"": None}, [None] * 3])


# ------------------------------------------------------------------- paths
# Where half the mutations start: the parts the checks and the runtime read.
FOCUS = [["methods"], ["metadata"], ["weights"], ["contract"], ["backend"], ["tokenizer"],
         ["graph_module", "signature"], ["graph_module", "graph", "inputs"], ["graph_module", "graph", "outputs"],
         ["graph_module", "graph", "tensor_values"], ["graph_module", "graph", "nodes"], ["range_constraints"],
         ["graph_module", "module_call_graph"], ["graph_module", "graph", "sym_int_values"]]


def random_path(doc, rng: random.Random) -> list:
    """A path into the JSON tree by random descent: every level is as
    likely to be hit, so a 300-node graph does not drown the signature."""
    path, here = [], doc
    if rng.random() < 0.5:
        starts = [f for f in FOCUS if _has(doc, f)]
        if starts:
            path = list(rng.choice(starts))
            here = at(doc, path)
    while isinstance(here, (dict, list)) and here and (not path or rng.random() < 0.75):
        key = rng.choice(list(here)) if isinstance(here, dict) else rng.randrange(len(here))
        path.append(key)
        here = here[key]
    return path


def _has(doc, path: list) -> bool:
    for key in path:
        if isinstance(doc, dict) and key in doc or isinstance(doc, list) and isinstance(key, int) and key < len(doc):
            doc = doc[key]
        else:
            return False
    return True


def at(doc, path: list):
    for key in path:
        doc = doc[key]
    return doc


def put(doc, path: list, value):
    if not path:
        return value
    at(doc, path[:-1])[path[-1]] = value
    return doc


def leaves(doc) -> list[tuple[list, object]]:
    """(path, value) of every scalar, but node metadata (the loader drops it)."""
    out, stack = [], [([], doc)]
    while stack:
        path, here = stack.pop()
        if not isinstance(here, (dict, list)):
            out.append((path, here))
            continue
        for key, value in here.items() if isinstance(here, dict) else enumerate(here):
            if not (key == "metadata" and "nodes" in path):
                stack.append((path + [key], value))
    return out


def plausible(doc, rng: random.Random) -> tuple[object, str]:
    """A scalar replaced by one of its own type, most from elsewhere in the
    document (another tensor's name, another size): what gets past the
    type checks into the graph."""
    found = leaves(doc)
    path, old = rng.choice(found)
    same = [v for _, v in found if type(v) is type(old) and v != old]
    if isinstance(old, bool):
        new = not old
    elif isinstance(old, int) and rng.random() < 0.6:
        new = rng.choice([old + 1, old - 1, 0, 1, -1, 2 * old])
    elif isinstance(old, float):
        new = rng.choice([0.0, -old, 2 * old, math.nan])
    else:
        new = rng.choice(same) if same else None
    return put(doc, path, new), f"plausible {'/'.join(str(k)[:40] for k in path)} -> {_short(new)}"


def inject(doc, rng: random.Random, canary: Path) -> tuple[object, str]:
    """Code aimed at the program text torch turns into Python: the call
    signature (argument names, the pytree specs of the arguments) and the
    names of values (a graph input's becomes a parameter of `forward`)."""
    payload = rng.choice(injections(canary))
    root_call = doc["graph_module"]["module_call_graph"][0]
    graph = doc["graph_module"].get("graph")
    if not (isinstance(root_call, dict) and isinstance(root_call.get("signature"), dict) and isinstance(graph, dict)):
        return doc, "inject: an earlier mutation left no signature"
    signature = root_call["signature"]
    roll = rng.random()
    if roll < 0.25 and signature.get("forward_arg_names"):
        names = signature["forward_arg_names"]
        names[rng.randrange(len(names))] = payload
        return doc, f"inject forward_arg_names -> {payload[:60]!r}"
    if roll < 0.5:
        leaf = {"type": None, "context": None, "children_spec": []}
        keyed = rng.random() < 0.5
        spec = {"type": "builtins.tuple", "context": "null" if keyed else payload, "children_spec": [
            {"type": "builtins.tuple", "context": "null", "children_spec": []},
            {"type": "builtins.dict", "context": json.dumps([payload]) if keyed else "[]", "children_spec": [leaf] if keyed else []},
        ]}
        signature["in_spec"] = json.dumps([1, spec])
        return doc, f"inject in_spec {'keys' if keyed else 'context'} -> {payload[:60]!r}"
    names = [v for k, v in _walk_pairs(graph.get("inputs", [])) if k == "name" and isinstance(v, str)]
    if not names:
        return doc, "inject: no input to rename"
    name = rng.choice(names)  # renamed everywhere, the forward_arg_names included
    text = json.dumps(doc).replace(json.dumps(name), json.dumps(payload))
    return json.loads(text), f"inject rename {name} -> {payload[:60]!r}"


def _walk_pairs(doc):
    stack = [doc]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield from item.items()
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def mutate(doc, rng: random.Random, canary: Path) -> tuple[object, str]:
    """One mutation of a JSON document; returns the document and a note."""
    if _has(doc, ["graph_module", "module_call_graph", 0]) and rng.random() < 0.08:
        return inject(doc, rng, canary)
    if rng.random() < 0.25:
        return plausible(doc, rng)
    path = random_path(doc, rng)
    old = at(doc, path)
    where = "/".join(str(k)[:40] for k in path) or "<root>"
    op = rng.choice(["retype", "number", "string", "wrap", "nest", "delete", "rekey", "flip", "splice", "append"])
    if op == "number" and isinstance(old, (int, float)) and not isinstance(old, bool):
        new = rng.choice([old + 1, old - 1, -old, 0, old * 2**40, old * 2**62, float(old), math.nan, 2**63])
    elif op == "string" and isinstance(old, str):
        new = rng.choice([old[:-1], old + "x", old * 1000, old.upper(), "../" + old, old + "\x00", old[::-1]])
    elif op == "wrap":
        new = rng.choice([[old], {"value": old}, {"name": old}, [old, old]])
    elif op == "nest":
        new = nested(rng.choice([2, 50, 400, 900, 990, 5000, 100_000]), rng)
    elif op == "delete" and path:
        parent = at(doc, path[:-1])
        del parent[path[-1]]
        return doc, f"delete {where}"
    elif op == "rekey" and path and isinstance(at(doc, path[:-1]), dict):
        parent = at(doc, path[:-1])
        parent[str(rng.choice(interesting_strings(canary)[:30] + ["x"]))] = parent.pop(path[-1])
        return doc, f"rekey {where}"
    elif op == "flip" and isinstance(old, dict):
        new = list(old.values()) if rng.random() < 0.5 else list(old.items())
    elif op == "flip" and isinstance(old, list):
        new = {str(i): v for i, v in enumerate(old)}
    elif op == "splice":
        new = copy.deepcopy(at(doc, random_path(doc, rng)))
    elif op == "append" and isinstance(old, list):
        new = old + [copy.deepcopy(rng.choice(old)) if old and rng.random() < 0.7 else random_value(rng, canary)]
    else:
        new = random_value(rng, canary)
        op = "retype"
    return put(doc, path, new), f"{op} {where} -> {_short(new)}"


def _short(value) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else f"{type(value).__name__}({len(value)})"
    return text[:60]


# ------------------------------------------------------------------ attack
def truncate(data: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data))] if data else data


def fix_checksums(pkg: Path) -> None:
    """What an attacker does after editing files: every file the manifest
    lists or points at gets its real checksum, where the manifest still
    parses and the path stays inside (we never hash a file outside)."""
    try:
        manifest = json.loads((pkg / "manifest.json").read_bytes())
    except (ValueError, RecursionError):
        return
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return
    rels = list(manifest["files"])
    weights = manifest.get("weights")
    rels.append(weights.get("file") if isinstance(weights, dict) else None)
    methods = manifest.get("methods")
    for entry in methods.values() if isinstance(methods, dict) else ():
        if isinstance(entry, dict):
            rels += [entry.get("program"), entry.get("compiled")]
    for rel in rels:
        if isinstance(rel, str) and confined_problem(rel) is None and rel != "manifest.json":
            path = pkg / rel
            try:
                if path.is_file() and not path.is_symlink():
                    manifest["files"][rel] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
            except OSError:  # a name too long, say: nothing to fix up
                continue
    try:
        (pkg / "manifest.json").write_bytes(dumps(manifest))
    except RecursionError:  # nested deeper than json.dumps writes: left as it is
        pass


def attack_weights(path: Path, rng: random.Random, canary: Path) -> list[str]:
    """The safetensors file: its JSON header (8 bytes of length first), its
    length field, or its bytes cut short."""
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header, body = json.loads(data[8 : 8 + size]), data[8 + size :]
    roll, notes = rng.random(), ["weights:"]
    if roll < 0.7:
        for _ in range(rng.choice([1, 1, 2])):
            header, note = mutate(header, rng, canary)
            notes.append(note)
        text = dumps(header)
        data = struct.pack("<Q", len(text)) + text + body
    elif roll < 0.85:
        data = truncate(data, rng)
        notes.append(f"truncated to {len(data)} bytes")
    else:
        length = rng.choice([0, 1, size - 1, size + 1, len(data), 2**63, 2**64 - 1])
        data = struct.pack("<Q", length) + data[8:]
        notes.append(f"header length {length}")
    path.write_bytes(data)
    return notes


def attack(pkg: Path, rng: random.Random, canary: Path) -> tuple[str | None, list[str]]:
    """Mutates the package in place; returns the method whose program
    changed (None for the manifest or the weights) and what was done."""
    methods = sorted(p.name.removesuffix(".json.gz") for p in (pkg / "programs").glob("*.json.gz"))
    roll = rng.random()
    if roll < 0.12:
        return None, attack_weights(pkg / "weights.safetensors", rng, canary) + fix_up(pkg, rng)
    method = None if roll < 0.55 else rng.choice(methods)
    path = pkg / "manifest.json" if method is None else pkg / "programs" / f"{method}.json.gz"
    doc = json.loads(path.read_bytes() if method is None else gzip.decompress(path.read_bytes()))
    notes = [f"{'manifest' if method is None else method}:"]
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        doc, note = mutate(doc, rng, canary)
        notes.append(note)
    data = dumps(doc)
    if rng.random() < 0.05:
        data = truncate(data, rng)
        notes.append(f"truncated to {len(data)} bytes")
    if method is not None:
        data = gzip.compress(data, mtime=0)
        if rng.random() < 0.03:
            data = truncate(data, rng)
            notes.append(f"gzip truncated to {len(data)} bytes")
    path.write_bytes(data)
    return method, notes + fix_up(pkg, rng)


def fix_up(pkg: Path, rng: random.Random) -> list[str]:
    if rng.random() < 0.85:
        fix_checksums(pkg)
        return []
    return ["checksums left stale"]


# ------------------------------------------------------------------- check
class Hang(BaseException):
    """Raised by the alarm: not an Exception, so no `except Exception` in
    the code under test can swallow it."""


def _on_alarm(signum, frame):
    raise Hang(f"still running after {HANG_SECONDS} s")


def prompt_for(method: str | None) -> tuple[list[int], SamplingConfig]:
    """A prompt whose first step runs `method` (the tiny package takes
    forward_1,2,4,8 and forward_others up to 24 tokens)."""
    if method is not None and method.startswith("forward_") and method[8:].isdigit():
        return list(range(1, int(method[8:]) + 1)), SamplingConfig()
    if method == "forward_others":
        return list(range(1, 13)), SamplingConfig()
    if method == "sample":
        return [1, 2, 3], SamplingConfig(temperature=0.8)
    return [1, 2, 3], SamplingConfig()  # a manifest case, or a single-sequence contract's forward


def exercise(pkg: Path, method: str | None, reached: Counter) -> list[str]:
    """Everything a user may do with the package; returns what an
    untrusted package must never cause. `reached` counts how far cases get."""
    stages = []

    def stage(name, call):
        try:
            return call()
        except KvexportError:
            return None
        except Exception as e:
            stages.append(f"{name}: {type(e).__name__}: {str(e)[:200]}\n{_where(e)}")
            return None

    report = None
    try:
        report = validate_package(pkg)
        if not isinstance(report, Report):
            stages.append(f"validate: returned {type(report).__name__}")
        else:
            render_report(report)
            reached["validate ok"] += report.ok
    except Exception as e:
        stages.append(f"validate raised {type(e).__name__}: {str(e)[:200]}\n{_where(e)}")
    stage("inspect", lambda: render_info(describe(pkg)))
    rt = stage("load", lambda: load(pkg))
    valid = isinstance(report, Report) and report.ok
    if rt is None:
        reached["valid, refused by load"] += valid
        return stages
    reached["loaded"] += 1
    # An untouched program rebuilds as in the good package: a program case
    # rebuilds only its own method, and runs a prompt that reaches it.
    names = [method] if method is not None else list(rt.package.manifest["methods"])
    for name in names:
        if stage(f"method {name}", lambda: rt.package.method(name) or True) is None:
            reached["valid, refused by a rebuild"] += valid
            return stages
    prompt, sampling = prompt_for(method)
    reached["methods rebuilt"] += 1
    if rt.package.manifest.get("tokenizer"):  # what `kvexport generate` reads then
        stage("tokenizer", rt.package.tokenizer)
    reached["generated"] += stage("generate", lambda: generate(rt, [prompt], max_new_tokens=2, sampling=sampling)) is not None
    return stages


def _where(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if "kvexport" in f.filename or "/work/" in f.filename] or frames
    return "    " + "\n    ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in ours[-3:])


@pytest.fixture(scope="module")
def sources(tiny_package) -> list[Path]:
    """One good package per contract: offgraph_kv, ingraph_kv, hf_static
    (the packages test_contracts.py exports too)."""
    single = dict(use_offgraph_kv_cache=False, max_step_tokens=16, max_context_len=128)
    return [tiny_package("tiny-llama")] + [tiny_package("tiny-llama", contract=c, **single) for c in ("ingraph_kv", "hf_static")]


def test_mutated_packages_are_refused_cleanly(tmp_path, sources, monkeypatch):
    canary = tmp_path / CANARY
    modules = tmp_path / "modules"  # an importable module that creates the canary
    modules.mkdir()
    (modules / f"{CANARY_MODULE}.py").write_text(f"open({str(canary)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(modules))
    cases = [int(ONLY)] if ONLY is not None else range(CASES)
    failures, slowest, start, reached = [], (0.0, None), time.perf_counter(), Counter()
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        for case in cases:
            rng = random.Random(f"{SEED}:{case}")
            pkg = tmp_path / f"case{case}"
            source = rng.choices(sources, weights=[4, 1, 1])[0]
            shutil.copytree(source, pkg)
            method, notes = attack(pkg, rng, canary)
            notes.insert(0, json.loads((source / "manifest.json").read_bytes())["contract"]["name"])
            t0 = time.perf_counter()
            signal.alarm(HANG_SECONDS)
            try:
                problems = exercise(pkg, method, reached)
            except Hang as e:
                problems = [f"hang: {e}\n{_where(e)}"]
            finally:
                signal.alarm(0)
            took = time.perf_counter() - t0
            slowest = max(slowest, (took, case), key=lambda x: x[0])
            if took > CASE_SECONDS:
                problems.append(f"took {took:.1f} s (at most {CASE_SECONDS})")
            if canary.exists():
                problems.append("injected code ran: the canary file exists")
                canary.unlink()
                sys.modules.pop(CANARY_MODULE, None)
            if problems:
                failures.append(f"case {case} ({' '.join(notes)}):\n  " + "\n  ".join(problems))
            shutil.rmtree(pkg, ignore_errors=True)
    finally:
        signal.signal(signal.SIGALRM, previous)
    summary = (
        f"{len(cases)} fuzz cases (seed {SEED}) in {time.perf_counter() - start:.1f} s, "
        f"slowest {slowest[0]:.1f} s (case {slowest[1]}); " + ", ".join(f"{k} {v}" for k, v in reached.items())
    )
    log.warning(summary)
    assert not failures, f"{summary}; {len(failures)} failed (replay one with KVEXPORT_FUZZ_CASE=N):\n" + "\n".join(failures[:30])


# ------------------------------------------------------ what it found
@pytest.fixture
def canary(tmp_path, monkeypatch) -> Path:
    """A file that importing CANARY_MODULE (importable for this test) creates."""
    path = tmp_path / CANARY
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / f"{CANARY_MODULE}.py").write_text(f"open({str(path)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(modules))
    monkeypatch.delitem(sys.modules, CANARY_MODULE, raising=False)
    return path


def _edit_sample_argmax(pkg: Path, edit) -> None:
    path = pkg / "programs" / "sample_argmax.json.gz"
    path.write_bytes(gzip.compress(dumps(edit(json.loads(gzip.decompress(path.read_bytes()))))))
    fix_checksums(pkg)


def _in_spec(args_context: str, kwargs: list[str]) -> str:
    leaf = {"type": None, "context": None, "children_spec": []}
    return json.dumps([1, {"type": "builtins.tuple", "context": args_context, "children_spec": [
        {"type": "builtins.tuple", "context": "null", "children_spec": []},
        {"type": "builtins.dict", "context": json.dumps(kwargs), "children_spec": [leaf] * len(kwargs)},
    ]}])


@pytest.mark.parametrize("vector", ["input name", "spec keys", "spec context"])
def test_text_torch_turns_into_python_is_refused(tmp_path, tiny_package, canary, vector):
    """Found by the fuzzer: torch 2.13 writes a graph input's name into the
    rebuilt module's `def forward(...)`, a spec's dict keys into a dict
    literal in its body, and decodes a spec's context with a hook that
    imports the module an `__enum__` object names. Each of these created
    the canary (on load, on the first call, and on load) and validated ok."""
    touch = f"__import__('os').system('touch {canary}')"
    pkg = tmp_path / "pkg"
    shutil.copytree(tiny_package("tiny-llama"), pkg)

    def edit(program):
        signature = program["graph_module"]["module_call_graph"][0]["signature"]
        if vector == "input name":
            return json.loads(json.dumps(program).replace('"logits"', json.dumps(f"x={touch}")))
        if vector == "spec keys":
            signature["in_spec"] = _in_spec("null", [f"x':{touch},'y"])
        else:
            signature["in_spec"] = _in_spec(json.dumps({"__enum__": True, "fqn": f"{CANARY_MODULE}:X", "name": "a"}), [])
        return program

    _edit_sample_argmax(pkg, edit)
    report = validate_package(pkg)
    assert any(v.startswith("methods.sample_argmax.program:") for v in report.violations), report.violations
    with pytest.raises(KvexportError, match="sample_argmax"):
        rt = load(pkg)
        rt.package.method("sample_argmax")
        generate(rt, [[1, 2, 3]], max_new_tokens=2)
    assert not canary.exists()


@pytest.mark.parametrize("where", ["parameter_name", "module fqn"])
def test_a_tensor_name_that_closes_a_string_in_generated_code_is_refused(tmp_path, tiny_package, canary, where):
    """Found in review: torch 2.13 writes a parameter's name into a
    `getattr(self, "...")` line of the rebuilt module's source, so a name
    holding a quote ran the code after it on the first call (the manifest's
    binding and an alias renamed to match, checksums fixed up)."""
    payload = f'x", __import__("{CANARY_MODULE}"))  #'
    pkg = tmp_path / "pkg"
    shutil.copytree(tiny_package("tiny-llama"), pkg)
    manifest = json.loads((pkg / "manifest.json").read_text())
    victim = "final_norm.weight"
    for method, entry in manifest["methods"].items():
        if victim not in entry["weights"]["parameters"]:
            continue
        path = pkg / entry["program"]
        program = json.loads(gzip.decompress(path.read_bytes()))
        if where == "parameter_name":
            specs = program["graph_module"]["signature"]["input_specs"]
            next(s for s in specs if s.get("parameter", {}).get("parameter_name") == victim)["parameter"]["parameter_name"] = payload
            entry["weights"]["parameters"] = [payload if n == victim else n for n in entry["weights"]["parameters"]]
        else:
            program["graph_module"]["module_call_graph"][-1]["fqn"] = payload
        path.write_bytes(gzip.compress(dumps(program)))
    if where == "parameter_name":
        manifest["weights"]["aliases"][payload] = victim
    (pkg / "manifest.json").write_bytes(dumps(manifest))
    fix_checksums(pkg)
    report = validate_package(pkg)
    assert any("dotted name" in v for v in report.violations), report.violations
    with pytest.raises(KvexportError, match="dotted name"):
        generate(load(pkg), [[1, 2, 3]], max_new_tokens=2)
    assert not canary.exists()
