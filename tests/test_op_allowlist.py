"""The exact operator allowlist (contract/op_allowlist.py): the exporter
emits nothing off it, and the kernels that trust their arguments, the
uninitialized and oversized allocations, and graphs too large to rebuild
are refused before torch's deserializer sees them, each naming its method
and its operator (validate lists it, load refuses it, the CLI exits 1).

    python tests/test_op_allowlist.py [PACKAGE ...]

prints the overloads the exporter emits now (across the variants below, or
in the given packages) and those not on the list: what to add, with a
reason, when the exporter changes.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from helpers import export_tiny, prompt_of
from test_package_safety import copy, edit_program
from kvexport.cli.main import main
from kvexport.contract.errors import PackageError
from kvexport.contract.op_allowlist import ALLOWED_OPS, MAX_NODES, SYMBOLIC_TARGETS, program_limits
from kvexport.contract.validate import validate_package
from kvexport.runtime import load

SINGLE_SEQUENCE = dict(use_offgraph_kv_cache=False, max_step_tokens=16, max_context_len=128)
# What the exporter's options change in a graph: each contract, dtype and
# quantization scheme (the families differ in norms, activations, windows).
VARIANTS = {
    "ingraph_kv": dict(SINGLE_SEQUENCE, contract="ingraph_kv"),
    "hf_static": dict(SINGLE_SEQUENCE, contract="hf_static"),
    "bf16": dict(dtype="bf16"),
    "8w": dict(qlinear="8w", qembedding="8w"),
    "4w": dict(qlinear="4w", qembedding="8w"),
    "8da4w": dict(qlinear="8da4w", qembedding="8w"),
}
FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma", "tiny-gemma2", "tiny-gemma3",
            "tiny-phi3", "tiny-olmo2", "tiny-granite", "tiny-smollm3", "tiny-starcoder2")


def emitted_targets(package: Path) -> set[str]:
    """Every node target of every stored program of a package."""
    found = set()
    for path in sorted(Path(package, "programs").glob("*.json.gz")):
        stack = [json.loads(gzip.decompress(path.read_bytes()))]
        while stack:
            item = stack.pop()
            if isinstance(item, dict):
                found.update(n["target"] for n in item.get("nodes", []) if isinstance(item.get("nodes"), list))
                stack.extend(v for v in item.values() if isinstance(v, (dict, list)))
            elif isinstance(item, list):
                stack.extend(v for v in item if isinstance(v, (dict, list)))
    return found


def off_the_list(package: Path) -> set[str]:
    return {t for t in emitted_targets(package) if t not in ALLOWED_OPS and t not in SYMBOLIC_TARGETS}


# --------------------------------------------------------------- the list
def test_every_listed_overload_exists():
    """A typo on the list would be a hole nobody sees."""
    import torch._inductor.inductor_prims  # noqa: F401  (registers prims.inductor_force_stride_order)

    for target in ALLOWED_OPS:
        _, _, namespace, op, overload = target.split(".")
        assert isinstance(getattr(getattr(getattr(torch.ops, namespace), op), overload), torch._ops.OpOverload), target


@pytest.mark.parametrize("qact", ["none", "int8"])
def test_the_aoti_backends_stored_programs_use_only_listed_overloads(tmp_path, qact):
    """What the aoti backend's passes store (its fused products over
    quantized weights, the rounding of int8 activations), without compiling:
    its partitioner on the portable pipeline."""
    from kvexport.partitioners.aoti.partitioner import AotiPartitioner

    aoti = [AotiPartitioner("cpu", kernel_rows=(1, 2, 4, 8), packed_rows=(1, 2))]
    package = export_tiny("tiny-llama", tmp_path / "aoti-4w", verify=False, qlinear="4w", qembedding="8w",
                          qact=qact, partitioners=aoti, forward_sizes="1,2,8").path  # 8: past the packed rows
    assert not off_the_list(package), "add these to contract/op_allowlist.py with the reason each is safe"


@pytest.mark.parametrize("family, variant", [(f, None) for f in FAMILIES] + [("tiny-llama", v) for v in VARIANTS])
def test_every_family_and_scheme_emits_only_listed_overloads(tiny_package, family, variant):
    """Fails when the exporter starts emitting an overload not on the list.
    The packages are the session's (test_architectures, test_contracts and
    test_quantization export the same recipes), so this costs little."""
    package = tiny_package(family, **VARIANTS.get(variant, {}))
    assert not off_the_list(package), f"{package}: add these to contract/op_allowlist.py with the reason each is safe"


def test_limits_follow_the_manifest(tiny_package):
    manifest = json.loads((tiny_package("tiny-llama") / "manifest.json").read_text())
    limits = program_limits(manifest)
    assert limits.max_nodes == 1024 + 1024 * 2  # two layers
    assert limits.max_literal_elements == 24 * 1031  # the widest step's logits
    assert program_limits({"metadata": {"get_n_caches": 10**6}}).max_nodes == MAX_NODES
    assert program_limits("not a manifest").max_nodes == 2048


# ---------------------------------------------------------------- attacks
# Each rewrites `sample_argmax` (logits [R, V] -> argmax [R]) as an attacker
# would: extra nodes, one of them returned, checksums fixed up.
KEYWORDS = ("dtype", "layout", "device", "pin_memory", "memory_format")  # keyword-only in the schemas


def _node(target: str, name: str, **inputs) -> dict:
    return {"target": f"torch.ops.aten.{target}", "name": name, "outputs": [{"as_tensor": {"name": name}}],
            "inputs": [{"name": k, "arg": v, "kind": 2 if k in KEYWORDS else 1} for k, v in inputs.items()],
            "metadata": {}, "is_hop_single_tensor_return": None}


def _ints(*values: int) -> dict:
    return {"as_ints": list(values)}


def _returning(nodes: list[dict], output: str | None = None):
    """An edit adding `nodes` to the graph (each typed like argmax's output)
    and returning `output` instead of argmax."""

    def edit(program):
        graph = program["graph_module"]["graph"]
        graph["nodes"] += nodes
        for node in nodes:
            graph["tensor_values"][node["name"]] = graph["tensor_values"]["argmax"]
        if output is not None:
            graph["outputs"] = [{"as_tensor": {"name": output}}]
            program["graph_module"]["signature"]["output_specs"][0]["user_output"]["arg"]["as_tensor"]["name"] = output

    return edit


CPU = {"as_device": {"type": "cpu", "index": None}}
ATTACKS = {
    # a chosen value at a chosen index past a fresh buffer: heap corruption
    "sparse write": ("_sparse_coo_tensor_with_dims_and_tensors", _returning([
        _node("arange.default", "where_to", end={"as_int": 2}, dtype={"as_scalar_type": 5}),
        _node("mul.Tensor", "far", self={"as_tensor": {"name": "where_to"}}, other={"as_int": 100000}),
        _node("unsqueeze.default", "indices", self={"as_tensor": {"name": "far"}}, dim={"as_int": 1}),
        _node("slice.Tensor", "index", self={"as_tensor": {"name": "indices"}}, dim={"as_int": 1}, start={"as_int": 0},
              end={"as_int": 1}),
        _node("slice.Tensor", "value", self={"as_tensor": {"name": "argmax"}}, dim={"as_int": 0}, start={"as_int": 0},
              end={"as_int": 1}),
        _node("_sparse_coo_tensor_with_dims_and_tensors.default", "sparse", sparse_dim={"as_int": 2},
              dense_dim={"as_int": 0}, size=_ints(2, 2), indices={"as_tensor": {"name": "index"}},
              values={"as_tensor": {"name": "value"}}),
        _node("_to_dense.default", "dense", self={"as_tensor": {"name": "sparse"}}),
    ])),
    # 65,536 elements of view over an 8-byte-a-row tensor: heap bytes out
    "unchecked view": ("_reshape_alias", _returning([
        _node("_reshape_alias.default", "wide", self={"as_tensor": {"name": "argmax"}}, size=_ints(65536), stride=_ints(1)),
    ], "wide")),
    # freed memory handed back as token ids
    "uninitialized": ("empty_like", _returning([
        _node("empty_like.default", "garbage", self={"as_tensor": {"name": "argmax"}}),
    ], "garbage")),
    # 12 GiB from one node, on every call
    "12 GiB": ("zeros", _returning([
        _node("zeros.default", "huge", size=_ints(3 << 30), dtype={"as_scalar_type": 7}, device=CPU),
    ])),
    "12 GiB of arange": ("arange.default argument 'end'", _returning([
        _node("arange.default", "huge", end={"as_int": 3 << 30}, dtype={"as_scalar_type": 7}, device=CPU),
    ])),
    "expanded past the package": ("expand.default argument 'size'", _returning([
        _node("expand.default", "huge", self={"as_tensor": {"name": "argmax"}}, size=_ints(1 << 20, 1 << 20)),
    ])),
    # a size computed in the graph: symbolic arithmetic multiplies past any bound
    "a computed size": ("argument 'size' is computed in the graph", _returning([
        _node("expand.default", "huge", self={"as_tensor": {"name": "argmax"}},
              size={"as_sym_ints": [{"as_name": "rows"}, {"as_int": -1}]}),
    ])),
    "a sparse layout": ("argument 'layout'", _returning([
        _node("_to_copy.default", "sparse", self={"as_tensor": {"name": "argmax"}}, layout={"as_layout": 1}),
    ])),
    "a meta tensor": ("argument 'device'", _returning([
        _node("_to_copy.default", "storageless", self={"as_tensor": {"name": "argmax"}},
              device={"as_device": {"type": "meta", "index": None}}),
    ], "storageless")),
}


def _refused_everywhere(pkg: Path, method: str, named: str) -> None:
    """validate lists it, load refuses it, `kvexport validate` and
    `kvexport generate` exit 1."""
    report = validate_package(pkg)
    assert any(v.startswith(f"methods.{method}.program") and named in v for v in report.violations), report.violations
    result = CliRunner().invoke(main, ["validate", str(pkg)])
    assert result.exit_code == 1 and named in result.output, result.output
    with pytest.raises(PackageError, match=method):
        load(pkg).package.method(method)
    ids = ",".join(map(str, prompt_of(5, 1)))
    result = CliRunner().invoke(main, ["generate", str(pkg), "--prompt-ids", ids, "--max-new-tokens", "2"])
    assert result.exit_code == 1 and "internal error" not in result.output, result.output
    assert method in result.output and named in result.output, result.output


@pytest.mark.parametrize("attack", ATTACKS)
def test_operators_that_trust_their_arguments_are_refused(tmp_path, tiny_package, attack):
    """Before: each validated ok (the allowlist admitted every aten
    overload but five), and generate crashed, leaked heap bytes or
    allocated 12 GiB."""
    named, edit = ATTACKS[attack]
    pkg = copy(tmp_path, tiny_package)
    edit_program(pkg, "sample_argmax", edit)
    _refused_everywhere(pkg, "sample_argmax", named)


def test_a_graph_of_more_nodes_than_its_layers_need_is_refused_unbuilt(tmp_path, tiny_package, monkeypatch):
    """Before: 100,000 nodes in a 1.2 MB file took 2 minutes and 2.4 GB to
    load (20,000 here: the same refusal, a fifth of the JSON to build). The
    count is checked before anything else is walked, and torch's
    deserializer never sees the graph."""
    from torch._export.serde import serialize as serde

    pkg = copy(tmp_path, tiny_package)
    chain = [_node("neg.default", f"n{i}", self={"as_tensor": {"name": f"n{i - 1}" if i else "argmax"}})
             for i in range(20_000)]
    edit_program(pkg, "sample_argmax", _returning(chain, "n19999"))
    rebuilt = []  # node counts of the graphs the deserializer saw: the good methods may rebuild
    real = serde.ExportedProgramDeserializer.deserialize

    def deserialize(self, program, *args, **kwargs):
        rebuilt.append(len(program.graph_module.graph.nodes))
        return real(self, program, *args, **kwargs)

    monkeypatch.setattr(serde.ExportedProgramDeserializer, "deserialize", deserialize)
    _refused_everywhere(pkg, "sample_argmax", "20001 nodes, more than the 3072")
    assert max(rebuilt, default=0) < 20_000


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:]:
        packages = [Path(p) for p in sys.argv[1:]]
    else:
        root = Path(tempfile.mkdtemp(prefix="kvexport-ops-"))
        packages = [export_tiny(f, root / f, verify=False).path for f in FAMILIES]
        packages += [export_tiny("tiny-llama", root / v, verify=False, **flags).path for v, flags in VARIANTS.items()]
    emitted = set().union(*map(emitted_targets, packages))
    print("\n".join(sorted(emitted)))
    print(f"{len(emitted)} emitted; not on the list: {sorted(t for t in emitted if t not in ALLOWED_OPS and t not in SYMBOLIC_TARGETS)}")
    print(f"listed but not emitted: {sorted(set(ALLOWED_OPS) - emitted)}")
