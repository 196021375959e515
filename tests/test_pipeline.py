"""The lowering pipeline: passes, partitioners, step-width checks, constant
names, graph dumps."""

from __future__ import annotations

import json

import pytest
import torch
import torch.fx
from safetensors.torch import load_file

from helpers import PROGRESS, TINY_LAYOUT, export_tiny, hf_greedy, prompt_of
from kvexport.exporter.sources.models import load_model
from kvexport.exporter.pipeline import export_package, reserve_constant_names
from kvexport.exporter.spec import build_spec
from kvexport.partitioners.base import TAG, Partitioner
from kvexport.partitioners.portable.partitioner import PortablePartitioner
from kvexport.passes.base import Pass, PassError, run_passes
from kvexport.passes.reserve_constant_names import ConstantNames
from kvexport.runtime import generate, load
from kvexport.contract.errors import ExportError
from kvexport.contract.step_width import StepWidthError


def spec_for(tmp_path, name="pkg", **overrides):
    flags = dict(model="tiny-llama", output=str(tmp_path / name), use_offgraph_kv_cache=True, **TINY_LAYOUT)
    flags.update(overrides)
    return build_spec(flags=flags)


def export(tmp_path, name="pkg", **kwargs):
    return export_package(spec_for(tmp_path, name), progress=lambda m: None, **kwargs)


# ------------------------------------------------------------------ passes
class Noop(Pass):
    name = "noop"

    def call(self, gm):
        return gm, False


class Broken(Pass):
    name = "broken"

    def call(self, gm):
        raise ValueError("cannot do it")


def test_run_passes_names_the_pass_method_and_predecessors():
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(PassError, match=r"pass broken failed on forward_4 \(passes before it: noop, noop\): ValueError: cannot do it"):
        run_passes(gm, [Noop(), Noop(), Broken()], "forward_4")


class Requires(Pass):
    name = "needs_relu"

    def requires(self, gm):
        if not any(n.target is torch.relu for n in gm.graph.nodes):
            raise AssertionError("no relu to work on")

    def call(self, gm):
        return gm, False


def test_requires_is_checked():
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(PassError, match="needs_relu.*no relu"):
        run_passes(gm, [Requires()], "m")


# ------------------------------------------------------------- partitioners
def test_portable_partition_tags_every_op(tmp_path):
    seen = {}

    class Recorder(PortablePartitioner):
        def lower(self, program, method):
            nodes = [n for n in program.graph_module.graph.nodes if n.op == "call_function"]
            seen[method] = all(n.meta.get(TAG, "").startswith("portable_") for n in nodes)
            return program

    export(tmp_path, partitioners=[Recorder()])
    assert seen and all(seen.values())


class Meddler(PortablePartitioner):
    backend_id = "meddler"

    def partition(self, gm):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(output):
            gm.graph.call_function(torch.ops.aten.zeros.default, ([1],))
        return 1


def test_a_partitioner_that_changes_the_graph_is_refused(tmp_path):
    with pytest.raises(ExportError, match="partitioner 'meddler' changed the graph of forward_1"):
        export(tmp_path, partitioners=[Meddler()])


def test_dump_graphs_after_each_step(tmp_path):
    export(tmp_path, dump_graphs=tmp_path / "graphs")
    steps = sorted(p.name for p in (tmp_path / "graphs" / "forward_4").iterdir())
    assert steps == ["1-trace.txt", "2-transform.txt", "3-fuse.txt", "4-backend_passes.txt", "5-partition_lower.txt",
                     "6-reserve_constant_names.txt"]
    assert "_assert_tensor_metadata" in (tmp_path / "graphs/forward_4/1-trace.txt").read_text()
    assert "_assert_tensor_metadata" not in (tmp_path / "graphs/forward_4/4-backend_passes.txt").read_text()
    assert "q_proj" in (tmp_path / "graphs/forward_4/2-transform.txt").read_text()
    assert "q_k_v_proj" in (tmp_path / "graphs/forward_4/6-reserve_constant_names.txt").read_text()
    assert {p.name for p in (tmp_path / "graphs").iterdir()} >= {"forward_1", "forward_others", "sample"}


# --------------------------------------------------------------- step width
class Reorder(PortablePartitioner):
    """A backend whose lowering moves input_pos to the front."""

    backend_id = "reorder"

    def __init__(self, declare: str):
        self.declare = declare

    def lower(self, program, method):
        specs = program.graph_signature.input_specs
        users = [i for i, s in enumerate(specs) if s.kind.name == "USER_INPUT"]
        if len(users) < 3 or not method.startswith("forward"):
            return program
        first, pos = users[0], users[1]
        placeholders = [n for n in program.graph_module.graph.nodes if n.op == "placeholder"]
        placeholders[first].prepend(placeholders[pos])
        specs.insert(first, specs.pop(pos))
        program.graph_module.recompile()
        return program

    def step_width(self, public):
        return self.declare


def test_reordering_backend_with_matching_declaration(tmp_path):
    result = export(tmp_path, partitioners=[Reorder("0:0")])
    manifest = json.loads((result.path / "manifest.json").read_text())
    assert manifest["methods"]["forward_4"]["step_width"] == "0:0"
    assert manifest["methods"]["forward_others"]["step_width"] == "0:0"


@pytest.mark.parametrize(
    "declare,message",
    [
        ("1:0", r"input 1 \(tokens\) does not feed the positions; positions come from input 0 \(input_pos\)"),
        ("0:1", "dim 1 is not the step"),
        ("1", "malformed"),
    ],
)
def test_reordering_backend_with_wrong_declaration(tmp_path, declare, message):
    with pytest.raises(PassError, match=f"check_step_width failed on forward_1.*{message}"):
        export(tmp_path, partitioners=[Reorder(declare)])


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """The lowered tiny-llama programs (forward_4 static, forward_others dynamic) as graph views."""
    from kvexport.contract.step_width import view_of_graph_module

    views = {}

    class Capture(PortablePartitioner):
        def lower(self, program, method):
            views[method] = view_of_graph_module(program.graph_module, list(program.graph_signature.user_inputs))
            return program

    export(tmp_path_factory.mktemp("sw"), partitioners=[Capture()])
    return views


@pytest.mark.parametrize("method", ["forward_4", "forward_others"])
@pytest.mark.parametrize(
    "spec,message",
    [
        ("1:0", None),
        ("1:", "malformed"), (":0", "malformed"), ("1:0:0", "malformed"), ("-1:0", "malformed"), ("a:b", "malformed"),
        (" 1:0", "malformed"), (10, "malformed"),
        ("99:0", "input 99 does not exist; the program takes 9 inputs"),
        ("0:1", r"input 0 \(tokens\) does not feed the positions; positions come from input 1 \(input_pos\)"),
        ("7:0", r"input 7 \(\w+\) does not feed the positions"),
        ("1:1", "dim 1 is not the step"),
    ],
)
def test_step_width_check(traced, method, spec, message):
    from kvexport.contract.step_width import check_step_width

    if message is None:
        check_step_width(spec, traced[method])
    else:
        with pytest.raises(StepWidthError, match=message):
            check_step_width(spec, traced[method])


# ----------------------------------------------------------- constant names
class LiftTable(Pass):
    """Attaches a new constant the way torch's lifting names them
    (`lifted_tensor_0`), multiplying the logits by it: a table of ones, a
    different shape for each method it runs on, so it changes no value."""

    name = "lift_table"

    def __init__(self):
        self.count = 0

    def call(self, gm):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        result = output.args[0][0]
        if result.meta["val"].dtype != torch.float32 or result.meta["val"].dim() != 2:
            return gm, False  # samplers
        self.count += 1
        source = result.args[0]  # the LM head's output, before the final cast
        table = torch.ones([1] * self.count + [result.meta["val"].shape[-1]])
        gm.register_buffer("lifted_tensor_0", table)
        with gm.graph.inserting_before(result):
            attr = gm.graph.get_attr("lifted_tensor_0")
            attr.meta["val"] = table
            scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (source, attr))
            scaled.meta["val"] = torch.empty(table.shape[:-2] + source.meta["val"].shape)
            rows = gm.graph.call_function(torch.ops.aten.squeeze.dims, (scaled, list(range(self.count - 1))))
            rows.meta["val"] = source.meta["val"]
        result.replace_input_with(source, rows)
        return gm, True


def _program_with_table(values):
    class WithTable(torch.nn.Module):
        def forward(self, x):
            return x * torch.tensor(values)  # an inline constant: torch lifts it as lifted_tensor_0

    return torch.export.export(WithTable(), (torch.ones(3),), strict=False)


def test_two_methods_with_different_tables_keep_their_own():
    programs = {"forward_1": _program_with_table([1.0, 2.0, 3.0]), "forward_2": _program_with_table([4.0, 5.0, 6.0])}
    assert list(programs["forward_1"].constants) == list(programs["forward_2"].constants) == ["lifted_tensor_0"]
    reserve_constant_names(programs)
    names = [list(p.constants)[0] for p in programs.values()]
    assert names[0] != names[1]
    x = torch.ones(3)
    assert programs["forward_1"].module()(x).tolist() == [1.0, 2.0, 3.0]
    assert programs["forward_2"].module()(x).tolist() == [4.0, 5.0, 6.0]


def test_a_new_constant_next_to_a_folded_table():
    program = _program_with_table([1.0, 2.0, 3.0])

    class AddTable(Pass):
        name = "add_table"

        def call(self, gm):
            gm.register_buffer("lifted_tensor_0", torch.tensor([10.0, 20.0, 30.0]))  # torch's next name clashes
            output = next(n for n in gm.graph.nodes if n.op == "output")
            result = output.args[0][0]
            with gm.graph.inserting_before(output):
                attr = gm.graph.get_attr("lifted_tensor_0")
                added = gm.graph.call_function(torch.ops.aten.add.Tensor, (result, attr))
                added.meta["val"] = result.meta["val"]
            output.args = ((added,),)
            return gm, True

    run_passes(program.graph_module, [AddTable()], "forward_1")
    program.graph_signature.output_specs[0].arg.name = "add"
    names = reserve_constant_names({"forward_1": program})
    assert sorted(program.constants) == ["kvexport_constant_0", "lifted_tensor_0"]
    assert program.constants["lifted_tensor_0"].tolist() == [1.0, 2.0, 3.0]
    assert program.constants["kvexport_constant_0"].tolist() == [10.0, 20.0, 30.0]
    assert program.module()(torch.ones(3)).tolist() == [11.0, 22.0, 33.0]
    assert set(names.bound) == {"lifted_tensor_0", "kvexport_constant_0"}


def test_a_name_bound_twice_fails_loudly():
    names = ConstantNames()
    names.reserve("w", torch.ones(2))
    names.reserve("w", torch.ones(2))  # the same value again is fine
    with pytest.raises(PassError, match="'w' is bound to two different tensors"):
        names.reserve("w", torch.zeros(2))


# ----------------------------------------------------------------- backends
def test_a_backend_registers_from_outside_the_project(tmp_path, tiny_package):
    """A backend is one registered object: this one takes the portable
    partitioner, decides an option once, declares a compile pass, compiles
    nothing, and marks the manifest; export and load work with no file of the
    project edited, and --dump-graphs shows what its compile pass makes while
    the stored programs stay as they were."""
    from kvexport.partitioners.registry import Backend, BackendOptions, _BACKENDS, register_backend
    from kvexport.partitioners.portable.partitioner import PortablePartitioner
    from kvexport.passes.base import Pass
    from kvexport.runtime import generate, load

    class NegateOutputs(Pass):
        name = "negate_outputs"

        def call(self, graph_module):
            output = next(n for n in graph_module.graph.nodes if n.op == "output")
            first = output.args[0][0]
            with graph_module.graph.inserting_before(output):
                negated = graph_module.graph.call_function(torch.ops.aten.neg.default, (first,))
            output.args = ((negated, *output.args[0][1:]),)
            graph_module.recompile()
            return graph_module, True

    compiled, configured = [], []

    def compile_nothing(ctx):
        compiled.append((sorted(ctx.methods), ctx.options.compile_workers))
        return {}

    def configure(spec):
        configured.append(spec.backend)
        return BackendOptions(spec.device, compile_workers=3)

    toy = Backend("toy", "a test backend", lambda options: [PortablePartitioner()], compile_nothing,
                  lambda options: {"marker": options.compile_workers}, configure=configure,
                  compile_passes=lambda options: [NegateOutputs()])
    register_backend(toy)
    try:
        result = export_tiny("tiny-llama", tmp_path / "pkg", backend="toy", dump_graphs=tmp_path / "dump")
    finally:
        del _BACKENDS["toy"]
    manifest = json.loads((result.path / "manifest.json").read_text())
    assert manifest["backend"] == {"id": "toy", "marker": 3} and configured == ["toy"]
    # no compile_workers hook: the memory plan counts its workers again once configure has decided them
    assert any("3 compile worker(s)" in line for line in PROGRESS[str(tmp_path / "pkg")])
    assert compiled == [(sorted(manifest["methods"]), 3)]
    [shown] = (tmp_path / "dump" / "forward_1").glob("*-compile_passes.txt")
    assert "aten.neg.default" in shown.read_text()
    prompt = prompt_of(11, 2)
    assert generate(load(result.path), [prompt], 5) == generate(load(tiny_package("tiny-llama")), [prompt], 5)


def test_steps_are_one_list():
    from kvexport.exporter import pipeline

    names = [step.title for step in pipeline.STEPS]
    assert names[:9] == ["memory plan", "backend options", "load", "reference (float)", "quantize", "reference", "build forward", "plan", "trace"]
    assert names[-1] == "commit"
    assert [s.dump for s in pipeline.STEPS if s.dump] == [
        "trace", "transform", "fuse", "backend_passes", "partition_lower", "reserve_constant_names"
    ]
    for name in ("memory plan", "load", "fuse sibling linears", "quantize", "reference", "plan", "trace", "compile", "commit"):
        assert name in pipeline.__doc__
