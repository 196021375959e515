"""Export and output side of "packages are data": what an export reads from a
model source (no linked file, no model code, no tokenizer past the
vocabulary, no sandbox refusal as a crash), what it writes beside the
package (no planted link followed), what the CLI prints of a package (no
terminal escape, no internal error) and what the runtime takes from a
package's sampler (ids inside the vocabulary)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from kvexport.cli.main import main
from kvexport.contract.errors import ExportError, ModelError, PackageError, SpecError
from kvexport.exporter.sources.models import load_model, source_weights

SECRET = "root:$6$SECRETHASH:19000:0:99999:7:::\n"


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def no_internal_error(result) -> None:
    assert "internal error" not in result.output and "Traceback" not in result.output, result.output


# ------------------------------------------------------------ model sources
@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny-llama directory with a tokenizer and a chat template."""
    from test_models import save_tokenizer

    path = tmp_path_factory.mktemp("source") / "model"
    load_model("tiny-llama").model.save_pretrained(str(path))
    save_tokenizer(path)
    assert (path / "chat_template.jinja").is_file()
    return path


def copy_of(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(source, target)
    return target


def plant(path: Path, target: Path) -> None:
    if path.exists():
        path.unlink()
    path.parent.mkdir(exist_ok=True)
    os.symlink(target, path)


@pytest.mark.parametrize("entry", ["chat_template.jinja", "model.safetensors", "config.json", "tokenizer.json",
                                   "additional_chat_templates/tool_use.jinja"])
def test_a_linked_file_of_a_source_is_refused(source, tmp_path, entry):
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    model = copy_of(source, tmp_path)
    plant(model / entry, secret)
    for read in (lambda: source_weights(str(model), "fp32"), lambda: load_model(str(model))):
        with pytest.raises(ModelError, match=f"{entry}: a symbolic link") as refused:
            read()
        assert "SECRET" not in str(refused.value)


def test_a_linked_folder_of_a_source_is_refused(source, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "tool_use.jinja").write_text("{{ messages }}")
    model = copy_of(source, tmp_path)
    os.symlink(outside, model / "additional_chat_templates")
    with pytest.raises(ModelError, match="additional_chat_templates: a symbolic link"):
        load_model(str(model))


def test_export_refuses_a_linked_chat_template_and_writes_nothing(source, tmp_path):
    secret = tmp_path / "secret.jinja"
    secret.write_text("SECRET {{ messages }}")
    model = copy_of(source, tmp_path)
    plant(model / "chat_template.jinja", secret)
    result = run("export", str(model), "-o", str(tmp_path / "pkg"), "--use-offgraph-kv-cache")
    assert result.exit_code == 1 and "chat_template.jinja: a symbolic link" in result.stderr, result.output
    assert not (tmp_path / "pkg").exists()


def hf_cache(source: Path, root: Path, repo: str = "models--acme--tiny") -> Path:
    """`source` laid out as the Hugging Face cache does: each file a blob,
    the snapshot's entries relative links to it."""
    blobs, snapshot = root / repo / "blobs", root / repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(source.iterdir())):
        shutil.copyfile(file, blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / file.name)
    (root / repo / "refs").mkdir()
    (root / repo / "refs" / "main").write_text("0123abcd")
    return snapshot


def test_hf_cache_links_into_its_blobs_still_load(source, tmp_path, monkeypatch):
    snapshot = hf_cache(source, tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert source_weights("acme/tiny", "fp32").export_bytes > 0
    loaded = load_model("acme/tiny")
    assert loaded.tokenizer is not None and loaded.provenance["source"]["revision"] == "0123abcd"
    assert load_model(str(snapshot)).tokenizer is not None  # the snapshot's path, given directly
    # a snapshot link that leads out of blobs/ is any other link
    secret = tmp_path / "secret.jinja"
    secret.write_text("SECRET {{ messages }}")
    plant(snapshot / "chat_template.jinja", secret)
    with pytest.raises(ModelError, match="chat_template.jinja: a symbolic link"):
        load_model("acme/tiny")


def test_a_linked_blobs_folder_is_not_the_cache(source, tmp_path):
    snapshot = hf_cache(source, tmp_path / "hub")
    blobs = snapshot.parent.parent / "blobs"
    blobs.rename(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", blobs)
    with pytest.raises(ModelError, match="a symbolic link"):
        load_model(str(snapshot))


def test_messages_never_print_a_files_bytes(source, tmp_path):
    """A shard that is no safetensors file: the header length the parser
    reads is the file's first 8 bytes, and its message used to show it."""
    model = copy_of(source, tmp_path)
    (model / "model.safetensors").write_text(SECRET)
    first_bytes = str(int.from_bytes(SECRET.encode()[:8], "little"))
    for read in (lambda: source_weights(str(model), "fp32"), lambda: load_model(str(model))):
        with pytest.raises(ModelError, match="model.safetensors: not a readable safetensors file") as refused:
            read()
        assert first_bytes not in str(refused.value) and "SECRET" not in str(refused.value)


def test_a_sources_code_never_runs_and_nothing_is_asked(source, tmp_path, monkeypatch):
    """auto_map names the source's own .py: transformers used to ask on
    stdin, and a "y" ran it."""
    model = copy_of(source, tmp_path)
    marker = tmp_path / "ran"
    (model / "custom.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast, LlamaConfig, LlamaForCausalLM\n"
        "class MyTokenizer(PreTrainedTokenizerFast): pass\nclass MyConfig(LlamaConfig): pass\n"
        "class MyModel(LlamaForCausalLM): pass\n"
    )
    for name, auto_map in (("tokenizer_config.json", {"AutoTokenizer": [None, "custom.MyTokenizer"]}),
                           ("config.json", {"AutoConfig": "custom.MyConfig", "AutoModelForCausalLM": "custom.MyModel"})):
        config = json.loads((model / name).read_text())
        config["auto_map"] = auto_map
        if name == "tokenizer_config.json":
            config["tokenizer_class"] = "MyTokenizer"
        (model / name).write_text(json.dumps(config))
    asked = []
    monkeypatch.setattr("builtins.input", lambda *a: asked.append(a) or "y")
    loaded = load_model(str(model))
    assert not marker.exists() and not asked
    assert loaded.tokenizer is None  # it needs code kvexport never runs: token ids only, with a warning


def test_a_tokenizer_past_the_vocabulary_is_refused(source, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = copy_of(source, tmp_path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 2000)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(str(model))
    with pytest.raises(ModelError, match="the tokenizer has 2000 tokens, the model's vocabulary 1031"):
        load_model(str(model))


def test_a_chat_template_the_sandbox_refuses_is_a_clear_error(source, tmp_path):
    model = copy_of(source, tmp_path)
    (model / "chat_template.jinja").write_text("{{ ''.__class__.__mro__ }}")
    with pytest.raises(ModelError, match="the chat template: does not render .SecurityError"):
        load_model(str(model))


def test_a_runaway_chat_template_in_a_source_is_refused_before_any_work(source, tmp_path):
    """The source's template is rendered with the package's bounded work at
    load, so a template that would allocate gigabytes fails in a moment."""
    model = copy_of(source, tmp_path)
    (model / "chat_template.jinja").write_text("{{ 'abc ' * 10**9 }}")
    with pytest.raises(ModelError, match="the chat template"):
        load_model(str(model))


# ------------------------------------------------- files written beside a package
def test_report_replaces_a_planted_link_instead_of_writing_through_it(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    report = tmp_path / "report.json"
    os.symlink(victim, report)
    result = run("export", "tiny-llama", "-o", str(tmp_path / "pkg"), "--forward-sizes", "0", "--report", str(report))
    assert result.exit_code == 1 and "--forward-sizes: 0" in result.stderr
    assert victim.read_text() == "precious"
    assert not report.is_symlink() and json.loads(report.read_text())["ok"] is False


def graphs() -> dict:
    program = SimpleNamespace(graph_signature="signature",
                              graph_module=SimpleNamespace(print_readable=lambda print_output: "graph"))
    return {"forward_1": program}


def test_dump_graphs_never_follows_a_planted_link(tmp_path):
    from kvexport.exporter.pipeline import GraphDump

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "1-trace.txt").write_text("precious")
    dump = tmp_path / "dump"
    os.symlink(victim, dump)  # the folder itself
    with pytest.raises(ExportError, match="dump: cannot write graphs there"):
        GraphDump(dump)("trace", graphs())
    dump.unlink()
    dump.mkdir()
    os.symlink(victim, dump / "forward_1")  # a method's folder
    with pytest.raises(ExportError, match="forward_1: cannot write graphs there"):
        GraphDump(dump)("trace", graphs())
    (dump / "forward_1").unlink()
    (dump / "forward_1").mkdir()
    os.symlink(victim / "1-trace.txt", dump / "forward_1" / "1-trace.txt")  # a graph's file: replaced
    GraphDump(dump)("trace", graphs())
    assert (victim / "1-trace.txt").read_text() == "precious"
    assert (dump / "forward_1" / "1-trace.txt").read_text() == "signature\n\ngraph"


# ------------------------------------------------------- what the CLI prints
ESCAPES = "\x1b]0;owned\x07\x1b[2J\rkvexport: ok\u202e"


@pytest.fixture(scope="module")
def package(tiny_package) -> Path:
    return tiny_package("tiny-llama")


def tampered(package: Path, tmp_path: Path, edit) -> Path:
    """A copy of `package` whose manifest `edit` changed (the manifest is
    not among the digested files: nothing to fix up)."""
    copy = tmp_path / "pkg"
    shutil.copytree(package, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def test_terminal_escapes_in_a_package_are_printed_escaped(package, tmp_path):
    def edit(manifest):
        manifest["metadata"]["note" + ESCAPES] = ESCAPES
        manifest["provenance"]["command"] = ["kvexport", ESCAPES]

    forged = tampered(package, tmp_path, edit)
    outputs = [run("inspect", str(forged)), run("inspect", str(forged), "--json"), run("validate", str(forged)),
               run("validate", str(forged), "--json"), run("diff", str(package), str(forged)),
               run("diff", str(package), str(forged), "--json")]
    for result in outputs:
        no_internal_error(result)
        assert not any(c in result.output for c in "\x1b\x07\r\u202e"), result.output
    assert "\\x1b]0;owned\\x07" in outputs[0].stdout  # shown, escaped
    assert json.loads(outputs[1].stdout)["metadata"]["note" + ESCAPES] == ESCAPES  # JSON keeps it, as \u escapes


def test_an_error_quoting_a_package_string_is_escaped(package, tmp_path):
    forged = tampered(package, tmp_path, lambda m: m["methods"].update({"x" + ESCAPES: m["methods"]["forward_1"]}))
    result = run("generate", str(forged), "--prompt-ids", "1,2")
    assert result.exit_code == 1
    no_internal_error(result)
    assert not any(c in result.output for c in "\x1b\x07\r\u202e"), result.output


def test_generated_text_spelled_by_a_tampered_tokenizer_is_escaped(source, tmp_path):
    """Every token of the package's tokenizer spelled with a terminal escape,
    its digest fixed up: the streamed text and the batch's show it escaped."""
    from helpers import export_tiny

    path = export_tiny(str(source), tmp_path / "pkg", verify=False).path
    tokenizer_json = path / "tokenizer" / "tokenizer.json"
    tokenizer = json.loads(tokenizer_json.read_text())
    tokenizer["model"]["vocab"] = {f"{word}\x1b[2J\r": i for word, i in tokenizer["model"]["vocab"].items()}
    tokenizer_json.write_text(json.dumps(tokenizer))
    manifest = json.loads((path / "manifest.json").read_text())
    data = tokenizer_json.read_bytes()
    manifest["files"]["tokenizer/tokenizer.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    for prompts in (["--prompt-ids", "5,6"], ["--prompt-ids", "5,6", "--prompt-ids", "7"]):
        result = run("generate", str(path), *prompts, "--max-new-tokens", "3")
        assert result.exit_code == 0, result.output
        assert "\\x1b[2J\\r" in result.stdout and not any(c in result.stdout for c in "\x1b\r"), result.stdout


def deep_chain(root: Path, depth: int) -> None:
    """depth nested folders, made (and later removed) one level at a time
    through descriptors: their path is longer than a path may be."""
    fd = os.open(root, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("a", dir_fd=fd)
        fd, parent = os.open("a", os.O_RDONLY, dir_fd=fd), fd
        os.close(parent)
    os.close(fd)


def remove_chain(root: Path, depth: int) -> None:
    for level in range(depth, 0, -1):
        fd = os.open(root, os.O_RDONLY)
        for _ in range(level - 1):
            fd, parent = os.open("a", os.O_RDONLY, dir_fd=fd), fd
            os.close(parent)
        os.rmdir("a", dir_fd=fd)
        os.close(fd)


def test_a_deep_folder_chain_is_a_violation_not_an_internal_error(package, tmp_path):
    deep = tampered(package, tmp_path, lambda m: None)
    deep_chain(deep, 1400)
    try:
        results = [run("validate", str(deep)), run("inspect", str(deep)), run("diff", str(package), str(deep)),
                   run("generate", str(deep), "--prompt-ids", "1,2", "--max-new-tokens", "1")]
        for result in results:
            no_internal_error(result)
        assert results[0].exit_code == 1 and "nested deeper than" in results[0].output
        assert results[3].exit_code == 1 and "nested deeper than" in results[3].output
    finally:
        remove_chain(deep, 1400)


# ------------------------------------------------------------ flags past their range
def test_a_seed_past_64_bits_is_a_clear_error(package):
    for seed, prompts in ((str(1 << 70), ["--prompt-ids", "1,2"]), (str((1 << 64) - 1), ["--prompt-ids", "1,2"] * 2),
                          ("-1", ["--prompt-ids", "1,2"])):
        result = run("generate", str(package), *prompts, "--max-new-tokens", "1", "--temperature", "1", "--seed", seed)
        no_internal_error(result)
        assert result.exit_code == 1 and "--seed must be in 0.." in result.stderr
    assert run("generate", str(package), "--prompt-ids", "1,2", "--max-new-tokens", "1", "--temperature", "1",
               "--seed", str((1 << 64) - 1)).exit_code == 0


def test_a_deeply_nested_set_value_is_a_clear_error(tmp_path):
    from kvexport.exporter.spec import build_spec

    deep = "[" * 10000 + "]" * 10000
    with pytest.raises(SpecError, match="--set forward_sizes: nested too deep"):
        build_spec(flags={"model": "tiny-llama", "output": "x"}, overrides=[f"forward_sizes={deep}"])
    recipe = tmp_path / "deep.toml"
    recipe.write_text(f"forward_sizes = {deep}\n")
    with pytest.raises(SpecError, match="deep.toml: nested too deep"):
        build_spec(str(recipe), {"model": "tiny-llama", "output": "x"})


# ------------------------------------------------------------ the package's sampler
@pytest.mark.parametrize("temperature, method", [(0.0, "sample_argmax"), (1.0, "sample")])
def test_a_sampler_id_past_the_vocabulary_is_refused(package, monkeypatch, temperature, method):
    from kvexport.runtime import SamplingConfig, generate, load

    runtime = load(package)
    real_run = runtime.package.run

    def run_method(name, *inputs):
        out = real_run(name, *inputs)
        return torch.full_like(out, 10**15) if name == method else out

    monkeypatch.setattr(runtime.package, "run", run_method)
    with pytest.raises(PackageError, match=f"methods.{method}: returned token id 1000000000000000, outside the vocabulary"):
        generate(runtime, [[1, 2, 3]], 1, SamplingConfig(temperature=temperature))
