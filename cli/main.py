"""The kvexport command line. It parses and renders; the exporter and the
runtime do the work."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from kvexport.contract import schemes
from kvexport.contract.display import escape_lines
from kvexport.contract.errors import KvexportError
from kvexport.contract.manifest import CONTRACTS, DEVICES, DTYPES
from kvexport.contract.package import WEIGHTS_MEMORY
from kvexport.partitioners.registry import backend_ids, get_backend

log = logging.getLogger("kvexport")


class KvexportGroup(click.Group):
    """Turns a KvexportError into one line on stderr and exit code 1; the
    traceback only with --debug. A message may quote a package's strings:
    it is escaped, so none reaches the terminal as a control sequence."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KvexportError as e:
            if ctx.meta.get("debug"):
                raise
            click.echo(f"kvexport: error: {escape_lines(str(e))}", err=True)
            ctx.exit(1)
        except KeyboardInterrupt:
            click.echo("kvexport: interrupted", err=True)
            ctx.exit(130)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as e:
            if ctx.meta.get("debug"):
                raise
            click.echo(f"kvexport: internal error: {type(e).__name__}: {escape_lines(str(e))} (run with --debug for the traceback)", err=True)
            ctx.exit(1)


@click.group(cls=KvexportGroup)
@click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
@click.option("-q", "--quiet", is_flag=True, help="Only errors on stderr.")
@click.pass_context
def main(ctx: click.Context, debug: bool, quiet: bool) -> None:
    """Export Hugging Face causal LMs to batching-runtime packages, and run them."""
    ctx.meta["debug"] = debug
    level = logging.DEBUG if debug else logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr, force=True)
    for noisy in ("torch", "transformers", "torchao", "accelerate"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if debug else logging.ERROR)


def _progress(message: str) -> None:
    log.info(message)


# ------------------------------------------------------------------ export
@main.command()
@click.argument("model", required=False)
@click.option("-o", "--output", type=click.Path(path_type=str), help="Package directory to write (required).")
@click.option("--use-offgraph-kv-cache", is_flag=True, help="Export the offgraph_kv batching contract (many sessions over a cell pool the runtime owns). Without it, export writes a single-sequence contract (see --contract).")
@click.option("--contract", type=click.Choice(list(CONTRACTS)), help="Single-sequence contract written without --use-offgraph-kv-cache: ingraph_kv (the default) keeps the cache inside the program; hf_static takes it as inputs in HF's static layout.")
@click.option("--forward-sizes", help="Static forward widths, e.g. 1,2,4,8,16,32,64 (the default).")
@click.option("--max-step-tokens", type=int, help="Widest step forward_others takes (default 4096).")
@click.option("--max-cells", type=int, help="Cell pool size get_offgraph_kv_max_cells (default 65536).")
@click.option("--max-context-len", type=int, help="Lower the model's context (default: the model's own).")
@click.option("--dtype", type=click.Choice(list(DTYPES)), help="Weights and cache dtype (default fp32).")
@click.option("--qlinear", type=click.Choice(list(schemes.QLINEAR)), help=f"Quantize linears. {schemes.help_text('linear')}.")
@click.option("--qlinear-algorithm", type=click.Choice(list(schemes.ALGORITHMS)), help="How a group's scale and offset are chosen: minmax (the default) or hqq (HQQ's search).")
@click.option("--qlinear-keep-8w", help="With --qlinear 4w: comma-separated module patterns kept at 8 bits (e.g. '*.down_proj'), or sensitive:FRACTION for the most sensitive FRACTION measured on a calibration text.")
@click.option("--qlinear-group-size", type=int, help="Group size (a power of two; default 32 for 4-bit, per channel for 8w).")
@click.option("--qact", type=click.Choice(list(schemes.QACT)), help="With --qlinear 8w, 4w or gguf: int8 rounds each row of a linear's input to int8 codes with a step per block of 32, the arithmetic of integer dot products; int8x2 adds the rounding error rounded alike, a second int8 term (about 15 bits of each activation, for twice the integer products); int16 rounds each block to int16 codes (16 bits: the accuracy of weight-only, at int8's speed for 8-bit codes on AVX2); int8-peak is int8 plus int8x2's second term on each row's peak blocks, those holding its largest magnitude (most of int8x2's accuracy for a few percent more products); none keeps it float (weight-only). Default, where the backend multiplies rounded activations on its own kernels (aoti on x86 with --packed-kernel on): int16 for linears of 8-bit codes, int8-peak for 4-bit ones; else none. Linears whose groups are not whole blocks of 32, or that share an embedding's codes, keep float activations; the coverage report lists them.")
@click.option("--qembedding", type=click.Choice(list(schemes.QEMBEDDING)), help=f"Quantize embeddings (a tied LM head shares the codes). {schemes.help_text('embedding')}.")
@click.option("--min-prefill-chunk", type=int, help="Fewest selected rows forward_others takes (get_min_prefill_chunk, default 1).")
@click.option("--backend", type=click.Choice(backend_ids()), help="; ".join(f"{b.id}: {b.description}" for b in map(get_backend, backend_ids())) + " (default portable).")
@click.option("--device", type=click.Choice(list(DEVICES)), help="aoti: the device to compile for (default cpu).")
@click.option("--compile-workers", type=int, help="aoti: parallel compile processes (default: one per core).")
@click.option("--row-kernel", type=click.Choice(["auto", "on", "off"]), help="aoti on x86: run fp32 and bf16 products over 1-16 rows on kvexport's row kernel, linked into the compiled code: auto (the default) where it read fp32 weights faster than the BLAS in a probe of this machine (bf16 ones at every row count), on at every row count, off never.")
@click.option("--packed-kernel", type=click.Choice(["on", "off"]), help="aoti on x86: run products by 4- and 8-bit packed weights (8w, 4w, --qembedding 8w's tied LM head) over 1-16 rows on kvexport's packed kernel, linked into the compiled code (default on); off leaves them to inductor's fused code.")
@click.option("--config", "recipe", help="A recipe: configs/NAME.toml, a path, or a shipped recipe's name.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe key (repeatable).")
@click.option("--overwrite", is_flag=True, help="Replace an existing package at the output path.")
@click.option("--verify/--no-verify", default=None, help="Store the model's own greedy tokens on probe prompts in the package, and refuse to write a package whose runtime does not reproduce them alone and batched (default: on).")
@click.option("--verify-tokens", type=int, help="Greedy tokens per probe prompt for --verify (default 8).")
@click.option("--max-memory", help="A budget for the export's private memory (e.g. 4GB): an export whose plan needs more stops before any work. Weights mapped from a safetensors checkpoint in the export's dtype do not count: the kernel pages them in and out.")
@click.option("--report", type=click.Path(path_type=Path), help="Write a JSON report here, also when the export fails: ok, error, the command, each step's time and peak memory, the memory plan and peak, sizes, quantization coverage and the verification result.")
@click.option("--dump-graphs", type=click.Path(path_type=Path), help="Write every method's graph after each pipeline step here.")
@click.option("--list-builtins", is_flag=True, help="List the built-in model names and exit.")
@click.option("--list-architectures", is_flag=True, help="List the supported Hugging Face architectures and exit.")
@click.pass_context
def export(
    ctx: click.Context,
    model: str | None,
    output: str | None,
    recipe: str | None,
    overrides: tuple[str, ...],
    report: Path | None,
    dump_graphs: Path | None,
    list_builtins: bool,
    list_architectures: bool,
    **flags,
) -> None:
    """Export MODEL (a Hugging Face directory, a .gguf file, or a built-in
    name) to the package directory given by -o."""
    from kvexport.exporter.sources.models import BUILTINS
    from kvexport.exporter.pipeline import export_package
    from kvexport.exporter.spec import build_spec

    if list_builtins:
        for name, what in BUILTINS.items():
            click.echo(f"{name:16} {what}")
        return
    if list_architectures:
        from kvexport.exporter.sources.architectures import ARCHITECTURES

        for arch in ARCHITECTURES.values():
            click.echo(f"{arch.name:24} {arch.family:14} built-in tiny-{arch.key}")
        return
    given = {k: v for k, v in flags.items() if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}
    if model is not None:
        given["model"] = model
    if output is not None:
        given["output"] = output
    command = ["kvexport", *sys.argv[1:]]
    steps: list = []
    try:
        spec = build_spec(recipe, given, overrides, command=command)
        result = export_package(spec, _progress, dump_graphs=dump_graphs, check_package=_check_package, steps=steps)
    except BaseException as e:
        if report is not None:
            _write_report(report, {"ok": False, "error": f"{type(e).__name__}: {e}", "command": command, "steps": steps})
        raise
    if report is not None:
        _write_report(report, {
            "ok": True, "error": None, "command": command, "package": str(result.path), "seconds": round(result.seconds, 2),
            "steps": result.steps, "methods": result.methods,
            "sizes": {"package_bytes": result.package_bytes, "weights_bytes": result.weights_bytes,
                      "package_over_weights": round(result.size_ratio, 4)},
            "coverage": result.coverage, "verification": result.verification, "memory": result.memory,
        })
    if result.coverage:
        from kvexport.exporter.quantization.quantize import coverage_summary

        for line in coverage_summary(result.coverage):
            click.echo(line)
    click.echo(
        f"wrote {result.path} in {result.seconds:.1f} s: {len(result.methods)} methods, "
        f"{_mb(result.package_bytes)} = {result.size_ratio:.3f} x the weights ({_mb(result.weights_bytes)})"
        + (f", peak private memory {result.memory['peak_private_mb']:.0f} MB" if result.memory.get("peak_private_mb") else "")
    )


def _write_report(path: Path, content: dict) -> None:
    from kvexport.exporter.output_files import write_file

    write_file(path, json.dumps(content, indent=1, default=str) + "\n")  # replaces a link at path, never follows it


def _check_package(root: Path) -> str:
    """The exported package, run by the reference runtime on its stored
    probes before it is placed: a line to show, or an error that refuses it."""
    from kvexport.runtime import load
    from kvexport.runtime.verify import check_reference

    result = check_reference(load(root, trust_native_code=True))  # compiled here, this moment
    if not result.ok:
        raise KvexportError(
            f"the exported package {result.summary}; it was not written. Run with --debug for the details, "
            "or --no-verify to write it unchecked"
        )
    return result.summary + "".join(f"\n  note: {n}" for n in result.notes)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


# ----------------------------------------------------------------- inspect
@main.command()
@click.argument("package", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def inspect(package: Path, as_json: bool) -> None:
    """Show a package's methods, metadata, sizes and provenance."""
    from kvexport.contract.inspect import describe, render

    info = describe(package)
    click.echo(json.dumps(info, indent=1, sort_keys=True) if as_json else render(info))


# ---------------------------------------------------------------- validate
@main.command()
@click.argument("package", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def validate(ctx: click.Context, package: Path, as_json: bool) -> None:
    """Check PACKAGE against its contract without running it: exit 0 when it
    holds, 1 with every violation listed when it does not."""
    from kvexport.contract.validate import render, validate_package

    report = validate_package(package)
    if as_json:
        click.echo(json.dumps({"path": report.path, "ok": report.ok, "checked": report.checked, "violations": report.violations}, indent=1))
    else:
        click.echo(render(report), err=not report.ok)
    ctx.exit(0 if report.ok else 1)


# ------------------------------------------------------------------ verify
@main.command()
@click.argument("package", type=click.Path(path_type=Path))
@click.option("--against", "model", metavar="MODEL", help="Compare with MODEL itself (a model directory, a .gguf file or a built-in name) instead of the package's stored reference: its greedy tokens on the same probes, in the package's dtype.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: {\"ok\", \"summary\", \"differences\", \"notes\"}.")
@click.option("--trust-native-code", is_flag=True, help="Run an aoti package's native code this once though it is not in the trust store.")
@click.pass_context
def verify(ctx: click.Context, package: Path, model: str | None, as_json: bool, trust_native_code: bool) -> None:
    """Rerun PACKAGE's stored probe prompts with the reference runtime, alone
    and batched, using only the package: exit 0 with one line when every
    greedy token and the first step's best logits match, 1 naming the first
    difference."""
    from kvexport.runtime import load
    from kvexport.runtime.verify import check_reference

    runtime = load(package, trust_native_code=trust_native_code)
    section, source = None, "the reference stored at export"
    if model is not None:
        section, source = _reference_of(runtime, model), f"{model} run by its own Hugging Face code"
    result = check_reference(runtime, section, source)
    if as_json:
        click.echo(json.dumps({"ok": result.ok, "summary": result.summary, "differences": result.differences,
                               "notes": result.notes}, indent=1))
    else:
        click.echo(result.summary, err=not result.ok)
        for note in result.notes:
            click.echo(f"  note: {note}")
    ctx.exit(0 if result.ok else 1)


def _reference_of(runtime, model: str):
    """Reference tokens of `model` on the probes the package stores (or on
    fresh ones), in the package's dtype."""
    from kvexport.contract.sections import ReferenceSection
    from kvexport.exporter import golden
    from kvexport.exporter.sources.models import load_model

    manifest = runtime.package.manifest
    if manifest.get("quantization"):
        raise KvexportError(
            "--against runs the model in float, and this package is quantized: their tokens are expected to differ. "
            "Its stored reference is the quantized model: run kvexport verify PKG without --against"
        )
    md = runtime.package.metadata
    loaded = load_model(model, md["dtype"])
    stored = ReferenceSection.parse(manifest.get("reference"))
    if stored is None:
        return golden.reference(loaded.model, loaded.tokenizer, dtype=md["dtype"], steps=8,
                                widest_static=max(md["forward_sizes"]), context=md["get_max_context_len"])
    probes = [{"name": p["name"], "prompt": p["prompt"], **golden.greedy(loaded.model, p["prompt"], stored.steps)}
              for p in stored.probes]
    return ReferenceSection(stored.steps, *golden.TOLERANCES[md["dtype"]], probes, stored.batch)


# -------------------------------------------------------------------- diff
@main.command()
@click.argument("package_a", type=click.Path(path_type=Path))
@click.argument("package_b", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON: {\"same\": bool, \"differences\": [{\"where\", \"a\", \"b\"}]}.")
@click.pass_context
def diff(ctx: click.Context, package_a: Path, package_b: Path, as_json: bool) -> None:
    """What differs between two packages: methods (I/O, step widths,
    bindings), metadata, compiled target, quantization, provenance, weights
    tensor by tensor (dtype, shape, digest) and files. Exit 0 when they are
    the same, 1 otherwise. Runs no code from either package."""
    from kvexport.contract.diff import diff_packages, render

    differences = diff_packages(package_a, package_b)
    if as_json:
        rows = [{"where": d.where, "a": d.a, "b": d.b} for d in differences]
        click.echo(json.dumps({"same": not differences, "differences": rows}, indent=1, default=str))
    else:
        click.echo(render(package_a, package_b, differences))
    ctx.exit(0 if not differences else 1)


# ------------------------------------------------------------ trust, digest
@main.command()
@click.argument("package", type=click.Path(path_type=Path))
@click.option("--remove", is_flag=True, help="Stop trusting PACKAGE.")
def trust(package: Path, remove: bool) -> None:
    """Trust PACKAGE's native code (an aoti package exported elsewhere): once
    its files match its manifest, record its manifest digest in the trust store."""
    from kvexport.contract import trust as store

    if remove:
        digest, removed = store.untrust_package(package)
        click.echo(f"{'no longer trusted' if removed else 'was not trusted'}: {digest} {package}")
        return
    digest = store.trust_package(package)
    click.echo(f"trusted: {digest} {package} (in {store.store_path()})")


@main.command()
@click.argument("package", type=click.Path(path_type=Path))
def digest(package: Path) -> None:
    """Print PACKAGE's manifest digest, the value --expect-digest pins."""
    from kvexport.contract.trust import package_digest

    click.echo(package_digest(package))


# ---------------------------------------------------------------- generate
def weights_option(default: str):
    """How generate and serve hold the package's weights (runtime.load's
    `weights`): generate, a short process, maps them by default (no copy to
    wait for); serve, a long one, copies them where they fit easily."""
    return click.option(
        "--weights", type=click.Choice(WEIGHTS_MEMORY), default=default, show_default=True,
        help="Hold the weights as a mapping of the package's file (shared with other processes through the page "
             "cache; a model larger than memory pages in), copied into this process's memory on transparent huge "
             "pages (private: faster decoding where TLB misses cost; one copy per process; refused where they do "
             "not fit), or auto: private where they take at most half the memory available, else mapped.")


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KvexportError(f"--prompt-ids {text!r}: expected comma-separated integers like 1,2,3") from None
    if not ids:
        raise KvexportError("--prompt-ids is empty")
    return ids


@main.command()
@click.argument("package", type=click.Path(path_type=Path))
@click.option("--prompt", "prompts", multiple=True, help="A prompt (repeat to run several sessions at once).")
@click.option("--prompt-ids", "prompt_ids", multiple=True, help="A prompt as token ids, e.g. 1,2,3 (repeatable; after the --prompt ones).")
@click.option("--raw", is_flag=True, help="Do not apply the chat template.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True, help="Tokens to generate per prompt.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="0 turns it off.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling: keep the smallest set of tokens whose probabilities sum to this (1.0 keeps all).")
@click.option("--seed", type=int, default=0, show_default=True, help="Prompt i samples with seed + i.")
@click.option("--max-cells", type=int, help="Cells the runtime allocates at most (default: the package's).")
@click.option("--host-sampler", is_flag=True, help="Sample on the host instead of the package's sample method.")
@click.option("--json", "as_json", is_flag=True, help='Print {"outputs": [...]} instead of streaming text.')
@click.option("--trust-native-code", is_flag=True, help="Run an aoti package's native code this once though it is not in the trust store.")
@click.option("--expect-digest", metavar="DIGEST", help="Load only the package whose manifest digest is DIGEST (and trust its native code).")
@click.option("--speculative", type=click.Choice(["off", "lookup", "draft"]), help="Speculative decoding: draft tokens by prompt lookup (n-grams of the text so far) or with --draft's package, and check them in one step. Greedy tokens are unchanged. Default: draft with --draft, else off.")
@click.option("--draft", "draft_package", type=click.Path(path_type=Path), help="A draft package sharing the tokenizer (a smaller model, or the same one quantized): it proposes tokens the package checks.")
@click.option("--max-draft", type=int, default=8, show_default=True, help="Most tokens a session drafts per step (it adapts to how many are kept).")
@click.option("--json-schema", "json_schema", type=click.Path(path_type=Path), help="A JSON schema file: every output is JSON that validates against it (the tokens it forbids are masked before each draw).")
@click.option("--regex", help="A regular expression every output matches in full.")
@weights_option("mapped")
def generate(
    package: Path,
    prompts: tuple[str, ...],
    prompt_ids: tuple[str, ...],
    raw: bool,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    max_cells: int | None,
    host_sampler: bool,
    as_json: bool,
    trust_native_code: bool,
    expect_digest: str | None,
    speculative: str | None,
    draft_package: Path | None,
    max_draft: int,
    json_schema: Path | None,
    regex: str | None,
    weights: str,
) -> None:
    """Generate from PACKAGE for one or more prompts, batched as concurrent sessions."""
    from kvexport.runtime import SamplingConfig, load
    from kvexport.runtime import generate as run_generate
    from kvexport.runtime.speculative import Speculation, resolve_mode
    from kvexport.runtime.text import TextStream

    if not prompts and not prompt_ids:
        raise KvexportError("nothing to generate for: pass --prompt TEXT or --prompt-ids 1,2,3")
    mode = resolve_mode(speculative, draft_package is not None, max_draft)
    options = {"max_cells": max_cells} if max_cells is not None else {}
    runtime = load(package, trust_native_code=trust_native_code, expect_digest=expect_digest, weights=weights, **options)
    speculation = None
    if mode != "off":
        draft = load(draft_package, trust_native_code=trust_native_code, weights=weights) if draft_package is not None else None
        speculation = Speculation(mode, draft=draft, max_draft=max_draft)
    text = runtime.package.tokenizer() if prompts or runtime.package.manifest.get("tokenizer") else None
    grammar = _grammar(runtime, text, json_schema, regex)
    ids = [text.encode(p, chat=not raw) for p in prompts] + [_parse_ids(p) for p in prompt_ids]
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    stream = TextStream(text) if text is not None and len(ids) == 1 and not as_json else None

    def on_token(i: int, token: int) -> None:
        if stream is not None:
            click.echo(escape_lines(stream.push(token)), nl=False)  # the package's tokenizer spells it

    outputs = run_generate(runtime, ids, max_new_tokens, sampling, seed, on_token, on_device_sampler=not host_sampler,
                           speculation=speculation, grammar=grammar)
    if as_json:
        records = [
            {"prompt_ids": p, "generated_ids": g, "text": text.decode(g) if text is not None else None}
            for p, g in zip(ids, outputs)
        ]
        report: dict = {"outputs": records}
        if speculation is not None:
            stats = speculation.stats
            report["speculation"] = {"mode": mode, "drafted": stats.drafted, "accepted": stats.accepted}
        click.echo(json.dumps(report))
    elif stream is not None:
        click.echo()
    else:
        for i, generated in enumerate(outputs):
            body = text.decode(generated) if text is not None else " ".join(map(str, generated))
            click.echo(f"--- output {i} ---\n{escape_lines(body)}")


def _grammar(runtime, text, json_schema: Path | None, regex: str | None):
    """The grammar --json-schema or --regex asks for (None without either),
    over `text`, the package's tokenizer (None: it has none)."""
    from kvexport.runtime.grammar import Grammar

    if json_schema is not None and regex is not None:
        raise KvexportError("--json-schema and --regex: pass one of them")
    if json_schema is None and regex is None:
        return None
    if json_schema is not None:
        try:
            schema = json_schema.read_text()
        except OSError as e:
            raise KvexportError(f"--json-schema {json_schema}: cannot read it ({e.strerror})") from None
        return Grammar.json_schema(text, schema, runtime.vocab_size, runtime.eos_ids)
    return Grammar.regex(text, regex, runtime.vocab_size, runtime.eos_ids)


# ------------------------------------------------------------------- serve
@main.command()
@click.argument("package", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0 exposes the server to the network).")
@click.option("--port", type=int, default=8000, show_default=True, help="Port to listen on (0 picks a free one, printed at start).")
@click.option("--api-key", envvar="KVEXPORT_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/* (or set KVEXPORT_API_KEY).")
@click.option("--model-name", help="The model id /v1/models reports (default: the package folder's name).")
@click.option("--max-sessions", type=int, default=32, show_default=True, help="Choices generated at once (each a session of the cell pool; at most 63).")
@click.option("--max-queue", type=int, default=256, show_default=True, help="Requests that may wait for a session; past it, 429.")
@click.option("--max-step-tokens", type=int, default=256, show_default=True, help="Tokens one engine step packs: every decoding session's next token, then slices of waiting prompts (chunked prefill).")
@click.option("--prefix-cache-cells", type=int, help="Cells the prefix cache may hold alone (0 turns it off; default: whatever the pool spares, evicted least recently used).")
@click.option("--max-cells", type=int, help="Cells the runtime allocates at most (default: the package's).")
@click.option("--max-body-bytes", type=int, default=4 << 20, show_default=True, help="Largest request body; past it, 413.")
@click.option("--grace-seconds", type=float, default=10.0, show_default=True, help="On SIGTERM: how long in-flight requests may finish before they are cancelled.")
@click.option("--verify/--no-verify", default=True, show_default=True, help="Rerun the package's stored probes before reporting ready.")
@click.option("--state-dir", type=click.Path(path_type=Path), help="Save the prefix cache's sessions here at shutdown (token ids and K/V, in the package's cell layout) and restore them at start; files saved for another package are not restored.")
@click.option("--trust-native-code", is_flag=True, help="Run an aoti package's native code though it is not in the trust store.")
@click.option("--expect-digest", metavar="DIGEST", help="Serve only the package whose manifest digest is DIGEST (and trust its native code).")
@click.option("--speculative", type=click.Choice(["off", "lookup", "draft"]), help="Speculative decoding: each decoding session drafts tokens by prompt lookup or with --draft's package, checked in the same step; drafts only fill the step up to its widest static method, so a full step decodes plainly. Greedy tokens are unchanged. Default: draft with --draft, else off.")
@click.option("--draft", type=click.Path(path_type=Path), help="A draft package sharing the tokenizer (a smaller model, or the same one quantized).")
@click.option("--max-draft", type=int, default=8, show_default=True, help="Most tokens a session drafts per step (it adapts to how many are kept).")
@weights_option("auto")
def serve(package: Path, host: str, port: int, **options) -> None:
    """Serve PACKAGE over an OpenAI-compatible HTTP API (POST
    /v1/chat/completions and /v1/completions, GET /v1/models, /health,
    /metrics), batching every request through one cell pool."""
    from kvexport.runtime.server import serve as run_server

    def listening(url: str) -> None:
        click.echo(f"kvexport: serving {escape_lines(str(package))} on {url} (loading; GET /health answers 200 when ready)", err=True)

    run_server(package, host, port, on_listening=listening, **options)


if __name__ == "__main__":
    main()
