"""The CLI through click's runner: export -> inspect -> generate, and the
errors a user meets (exit 1, one line, no traceback)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from helpers import prompt_of
from kvexport.cli.main import main
from kvexport.runtime import generate, load


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


SMALL = ["--use-offgraph-kv-cache", "--forward-sizes", "1,2,4", "--max-step-tokens", "12", "--max-cells", "128"]


@pytest.fixture(scope="module")
def cli_package(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "pkg"
    result = run("export", "tiny-qwen2", "-o", str(out), *SMALL)
    assert result.exit_code == 0, result.output
    assert "[1/6] forward_1 traced in" in result.stderr  # progress: method, i of n, seconds
    assert "x the weights" in result.stdout
    return out


def test_inspect_text_and_json(cli_package):
    text = run("inspect", str(cli_package))
    assert text.exit_code == 0
    assert "offgraph_kv v1" in text.stdout and "forward_others" in text.stdout and "T[5..12]" in text.stdout
    info = json.loads(run("inspect", str(cli_package), "--json").stdout)
    assert info["contract"] == {"name": "offgraph_kv", "version": 1}
    assert info["methods"]["forward_4"]["inputs"][0]["shape"] == [1, 4]
    assert info["metadata"]["forward_sizes"] == [1, 2, 4]
    assert info["sizes"]["weights_bytes"] > 0 and info["provenance"]["source"]["builtin"] == "tiny-qwen2"


def test_generate_json_matches_the_runtime(cli_package):
    prompts = [prompt_of(5, seed=1), prompt_of(17, seed=2)]
    args = ["generate", str(cli_package), "--max-new-tokens", "10", "--json"]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    result = run(*args)
    assert result.exit_code == 0, result.output
    outputs = json.loads(result.stdout)["outputs"]
    assert [o["prompt_ids"] for o in outputs] == prompts
    assert [o["generated_ids"] for o in outputs] == generate(load(cli_package), prompts, 10)


def test_generate_with_private_weights_gives_the_mapped_tokens(cli_package, monkeypatch):
    import kvexport.runtime

    base = ["generate", str(cli_package), "--prompt-ids", "5,6,7", "--max-new-tokens", "8", "--json"]
    loaded = []
    real_load = kvexport.runtime.load
    monkeypatch.setattr(kvexport.runtime, "load", lambda *a, **k: loaded.append(k["weights"]) or real_load(*a, **k))
    private = run(*base, "--weights", "private", "--draft", str(cli_package))
    assert private.exit_code == 0, private.output
    assert loaded == ["private", "private"], "the package and its draft"
    assert json.loads(private.stdout)["outputs"] == json.loads(run(*base).stdout)["outputs"]  # greedy: the draft changes none
    refused = run(*base, "--weights", "huge")
    assert refused.exit_code == 2 and "'mapped'" in refused.output
    monkeypatch.setattr("kvexport.contract.package.available_memory", lambda: 1000)
    too_large = run(*base, "--weights", "private")
    assert too_large.exit_code == 1 and "--weights mapped" in too_large.output and "Traceback" not in too_large.output


def test_serve_copies_weights_that_fit_by_default(cli_package, monkeypatch):
    """serve, a long process, holds the weights "auto" (copied where they
    fit easily) unless told otherwise; generate maps them (above)."""
    import kvexport.runtime.server

    asked = []
    monkeypatch.setattr(kvexport.runtime.server, "serve", lambda *a, **k: asked.append(k["weights"]))
    assert run("serve", str(cli_package)).exit_code == 0
    assert run("serve", str(cli_package), "--weights", "mapped").exit_code == 0
    assert asked == ["auto", "mapped"]


def test_generate_sampling_flags(cli_package):
    base = ["generate", str(cli_package), "--prompt-ids", "5,6,7", "--max-new-tokens", "12", "--json"]
    sampled = json.loads(run(*base, "--temperature", "1.5", "--top-k", "50", "--seed", "3").stdout)
    host = json.loads(run(*base, "--temperature", "1.5", "--top-k", "50", "--seed", "3", "--host-sampler").stdout)
    greedy = json.loads(run(*base).stdout)
    assert sampled == host
    assert sampled != greedy


def expect_error(result, *fragments: str) -> None:
    assert result.exit_code == 1, result.output
    assert "kvexport: error:" in result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


@pytest.mark.parametrize(
    "args,fragments",
    [
        (["./no/such/model"], ["no such file or directory"]),
        (["tiny-gpt"], ["'tiny-gpt' is neither a path nor a built-in", "tiny-llama"]),
        (["tiny-llama", "--forward-sizes", "0,1"], ["0 is not a positive size"]),
        (["tiny-llama", "--forward-sizes", "1,-2"], ["-2 is not a positive size"]),
        (["tiny-llama", "--forward-sizes", "1,2,2"], ["2 is listed twice"]),
        (["tiny-llama", "--forward-sizes", "1,two"], ["'two' is not an integer"]),
        (["tiny-llama", "--forward-sizes", "1,8", "--max-step-tokens", "8"], ["--max-step-tokens 8 must be wider than the widest forward size 8"]),
        (["tiny-llama", "--max-step-tokens", "100", "--max-cells", "100"], ["--max-cells 100 must be above --max-step-tokens 100"]),
        (["tiny-llama", "--max-step-tokens", "100", "--max-cells", "50"], ["--max-cells 50 must be above"]),
        (["tiny-llama", "--set", "row_kernel=sometimes"], ["--row-kernel must be one of auto, on, off, got 'sometimes'"]),
    ],
)
def test_export_errors(tmp_path, args, fragments):
    flags = [a for a in ("--use-offgraph-kv-cache",) if "--use-offgraph-kv-cache" not in args]
    expect_error(run("export", *args, "-o", str(tmp_path / "pkg"), *flags), *fragments)
    assert not (tmp_path / "pkg").exists()


def test_an_unknown_model_is_refused_before_the_backend_measures_the_machine(tmp_path, monkeypatch):
    """A mistyped model name fails in the memory plan, from the name alone:
    the aoti backend's probe (seconds to minutes) never runs for it."""
    from kvexport.partitioners.aoti.kernels import probe

    def measured(*args):
        raise AssertionError("the probe ran")

    monkeypatch.setattr(probe, "kernel_rows", measured)
    result = run("export", "smollm2-13m", "--backend", "aoti", "--use-offgraph-kv-cache", "-o", str(tmp_path / "pkg"))
    expect_error(result, "'smollm2-13m' is neither a path nor a built-in", "smollm2-135m")


def test_without_the_flag_the_in_graph_contract(tmp_path):
    result = run("export", "tiny-llama", "-o", str(tmp_path / "pkg"), "--max-step-tokens", "8", "--max-context-len", "32")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "pkg" / "manifest.json").read_text())["contract"]["name"] == "ingraph_kv"


def test_debug_shows_the_traceback(tmp_path):
    result = CliRunner().invoke(main, ["--debug", "export", "tiny-gpt", "-o", str(tmp_path / "p"), "--use-offgraph-kv-cache"])
    assert result.exit_code != 0 and result.exception is not None


def test_recipe_unknown_key_names_file_and_key(tmp_path):
    recipe = tmp_path / "bad.toml"
    recipe.write_text('model = "tiny-llama"\nforward_size = [1, 2]\n')
    expect_error(run("export", "-o", str(tmp_path / "pkg"), "--config", str(recipe)), str(recipe), "'forward_size'")


def test_recipe_flags_and_overrides(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        'model = "tiny-llama"\nuse_offgraph_kv_cache = true\nforward_sizes = [1, 2, 4, 8]\n'
        "max_step_tokens = 32\nmax_cells = 100\n"
    )
    out = tmp_path / "pkg"
    # flag beats recipe, --set beats flag
    result = run("export", "-o", str(out), "--config", str(recipe), "--forward-sizes", "1,2", "--max-cells", "300", "--set", "max_cells=200")
    assert result.exit_code == 0, result.output
    md = json.loads((out / "manifest.json").read_text())["metadata"]
    assert md["forward_sizes"] == [1, 2]
    assert md["get_max_seq_len"] == 32
    assert md["get_offgraph_kv_max_cells"] == 200


def test_shipped_recipe_is_found_by_name(tmp_path):
    result = run("export", "-o", str(tmp_path / "pkg"), "--config", "tiny-test", "--set", "model=tiny-llama")
    assert result.exit_code == 0, result.output


def test_set_unknown_key(tmp_path):
    expect_error(run("export", "tiny-llama", "-o", str(tmp_path / "p"), "--set", "max_celss=3"), "unknown key 'max_celss'")


def test_generate_errors(cli_package, tmp_path):
    expect_error(run("generate", str(cli_package), "--prompt", "hello"), "carries no tokenizer", "--prompt-ids")
    expect_error(run("generate", str(cli_package), "--prompt-ids", "1,x"), "--prompt-ids")
    expect_error(run("generate", str(cli_package)), "--prompt")
    expect_error(run("generate", str(tmp_path / "none"), "--prompt-ids", "1"), "no such package")
    expect_error(run("generate", str(cli_package), "--prompt-ids", "1,99999"), "outside the vocabulary")
    expect_error(run("generate", str(cli_package), "--prompt-ids", "1,2", "--top-p", "0"), "--top-p")


def test_export_report_for_ci(tmp_path):
    report = tmp_path / "report.json"
    result = CliRunner().invoke(main, ["export", "tiny-qwen2", "-o", str(tmp_path / "pkg"), "--use-offgraph-kv-cache",
                                       "--forward-sizes", "1,4", "--max-step-tokens", "16", "--report", str(report)])
    assert result.exit_code == 0, result.output
    info = json.loads(report.read_text())
    assert info["ok"] is True and info["error"] is None and info["command"][0] == "kvexport"  # sys.argv: pytest's here
    steps = [s["step"] for s in info["steps"]]
    assert steps[:3] == ["memory plan", "backend options", "load"] and steps[-1] == "commit" and all(s["peak_rss_mb"] > 0 for s in info["steps"])
    assert 0 < info["memory"]["peak_private_mb"] <= info["memory"]["peak_rss_mb"]
    assert info["sizes"]["package_bytes"] > info["sizes"]["weights_bytes"] > 0
    assert info["verification"].startswith("verified: 3 probes")
    failed = CliRunner().invoke(main, ["export", "tiny-qwen2", "-o", str(tmp_path / "pkg"), "--use-offgraph-kv-cache",
                                       "--report", str(report)])  # the package exists: no --overwrite
    assert failed.exit_code == 1
    info = json.loads(report.read_text())
    assert info["ok"] is False and "exists" in info["error"]
