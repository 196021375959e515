"""llama.cpp beside kvexport on the same model, in one command: decode at
batch 1, 8 sequences aggregated, and a 512-token prompt, for llama.cpp F32,
BF16, Q8_0 and Q4_0 and for the packages given.

    python bench/llamacpp.py [--package fp32-aoti=PKG ...] [--model smollm2-135m] [--rounds 3] [--turns 6]
    python bench/llamacpp.py --shape llama3.2-1b [--export fp32,bf16,8w,4w] [--rounds 2]
    python bench/llamacpp.py --export fp32,bf16,8w,4w,gguf --isa avx2

With --shape, the model is a real size (bench/big_model.py's shapes): random
weights in the shape's architecture, with SmolLM2's tokenizer and vocabulary
(49152 tokens: nothing comes from a model hub, and llama.cpp needs a real
tokenizer), written once as a Hugging Face directory in the cache. llama.cpp
converts that directory; `--export` exports kvexport's aoti packages of it
(`--forward-sizes 1,8 --max-step-tokens 512 --row-kernel on`: the probe
that `auto` runs misjudges rows on a busy machine; quantized ones with
`--qembedding 8w`; kept in the cache) and measures them beside it, so both
read the same model at every precision.

llama.cpp is built from the vendored tree of the `llama-cpp-python==0.3.36`
sdist (fetched from the package registry; CMake, CPU only, -march=native),
once, in kvexport's cache directory (`$KVEXPORT_CACHE_DIR/llama.cpp-0.3.36`,
8-25 minutes on 2 cores). The built-in SmolLM2 goes to F32 by
`llama-quantize --allow-requantize` from its own GGUF (the values kvexport's
fp32 model holds); another model through `convert_hf_to_gguf.py` (which
needs sentencepiece). `llama-quantize` then makes BF16, Q8_0 and Q4_0.
`llama-bench` gives the batch-1 decode (tg) and prompt (pp) rates,
`llama-batched-bench` the 8-sequence aggregate. For the built-in SmolLM2
llama.cpp also runs its own GGUF file (GGUF), which `--export gguf` keeps.
`--isa avx2` builds llama.cpp a second time for AVX2 alone (GGML_NATIVE
off, no AVX-512 or VNNI) and exports kvexport's packages for AVX2; `--isa
avx512` for AVX-512 with VNNI and BF16 but no AMX (a VM may list AMX that it
refuses: a -march=native llama-bench died with SIGILL on Q8_0). `--omp-passive` sets
OMP_WAIT_POLICY=passive, which keeps its threads from spinning on a shared
machine (and costs it speed on a quiet one). Each package is
measured with bench/decode.py and bench/prefill.py in the same run, its
weights held as `--weights` says (mapped, the runtime's default, or
private: copied onto huge pages).

Then, with `--turns N` (default 6), each package's decode is measured again
beside llama.cpp on the GGUF of its precision (fp32: F32, bf16: BF16, 8w:
Q8_0, 4w: Q4_0, gguf: GGUF; by the label's first part), at batch 1 and over
8 sessions, in N rounds of short alternating turns (bench/paired_decode.py):
on a machine whose memory reads at two rates that switch within seconds
(the README's "Batch 1 in alternating turns"), these medians compare the two
tools, where the figures of one long run each mostly tell which rate each
run drew. They go under each package's `turns`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from common import code_digest, cpu_model, drop_older, emit
from kvexport.contract.package import WEIGHTS_MEMORY
from kvexport.exporter.sources.models import cache_dir, load_model

VERSION = "0.3.36"
TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-server")
HERE = Path(__file__).resolve().parent


def run(cmd: list, capture: bool = True, **kwargs) -> str:
    """Runs cmd; its output is returned, or shown as it goes (capture=False)."""
    print("+", " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    out = subprocess.PIPE if capture else sys.stderr
    return subprocess.run(cmd, check=True, text=True, stdout=out, **kwargs).stdout


# llama.cpp's CMake flags for each instruction set the bench can ask for, and its build folder
ISAS = {"native": ("build", ["-DGGML_NATIVE=ON"]),
        "avx2": ("build-avx2", ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                                "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF"]),
        # AVX-512 with VNNI and BF16, no AMX: a VM can list AMX (lscpu) that -march=native then uses and
        # the machine refuses (llama-bench died with SIGILL on Q8_0 on an Intel Xeon, 2026-12-04)
        "avx512": ("build-avx512", ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                                    "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON",
                                    "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX_VNNI=ON",
                                    "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"])}

# What kvexport's side runs under for each: its compiled code and kernels (ATEN_CPU_CAPABILITY) and the
# libraries torch calls, oneDNN (bf16 products and attention, which use AMX where the CPU lists it: a bf16
# 512 x 2048 x 8192 product ran 1647 GFLOPS against 197 without, Intel Xeon, 2026-12-05) and MKL (fp32
# products), so that neither side runs an instruction set the other may not
ISA_ENV = {"native": {},
           "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
           "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                      "MKL_ENABLE_INSTRUCTIONS": "AVX512"}}


def build(root: Path, isa: str = "native") -> Path:
    """The folder of llama.cpp's TOOLS built for `isa` (its bin/)."""
    tree = root / "llama.cpp"
    folder, flags = ISAS[isa]
    binaries = tree / folder / "bin"
    if all((binaries / t).exists() for t in TOOLS):
        return binaries
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.exists():
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={VERSION}", "-d", str(root)])
    if not tree.exists():
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix):]
            archive.extractall(tree, members=[m for m in members if m.name], filter="data")
    run(["cmake", "-S", str(tree), "-B", str(tree / folder), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", *flags,
         "-DLLAMA_CURL=OFF", "-DGGML_CUDA=OFF", "-DLLAMA_BUILD_TESTS=OFF"], capture=False)
    run(["cmake", "--build", str(tree / folder), "--target", *TOOLS, "-j", str(os.cpu_count() or 1)], capture=False)
    return binaries


def models(binaries: Path, root: Path, model: str) -> dict[str, Path]:
    """F32, BF16, Q8_0 and Q4_0 GGUF files of `model` (converted once); for
    the built-in SmolLM2 also its own GGUF (GGUF), the file `--qlinear gguf` keeps."""
    out = {"F32": f32_gguf(binaries, root, model)}
    for kind in ("BF16", "Q8_0", "Q4_0"):
        out[kind] = root / f"{Path(model).name}-{kind}.gguf"
        if not out[kind].exists():
            run([str(binaries / "llama-quantize"), str(out["F32"]), str(out[kind]), kind], capture=False)
    if model == "smollm2-135m":
        from kvexport.exporter.sources.models import _smollm2_gguf

        out["GGUF"] = _smollm2_gguf()
    return out


def f32_gguf(binaries: Path, root: Path, model: str) -> Path:
    """The F32 GGUF file of `model` (converted once)."""
    out = root / f"{Path(model).name}-F32.gguf"
    if out.exists():
        return out
    if model == "smollm2-135m":
        # the GGUF kvexport's own fp32 model is dequantized from: the same values
        from kvexport.exporter.sources.models import _smollm2_gguf

        run([str(binaries / "llama-quantize"), "--allow-requantize", str(_smollm2_gguf()),
             str(out), "F32"], capture=False)
    else:  # needs convert_hf_to_gguf.py's own requirements (sentencepiece, numpy)
        import importlib.util

        if importlib.util.find_spec("sentencepiece") is None:
            raise SystemExit("llama.cpp's convert_hf_to_gguf.py needs sentencepiece for this model: "
                             f"{sys.executable} -m pip install -e '.[bench]' (kvexport's bench extra)")
        tree = root / "llama.cpp"
        hf_dir = Path(model) if Path(model).is_dir() else root / f"{model}-hf"
        if not (hf_dir / "config.json").exists():
            loaded = load_model(model)
            loaded.model.save_pretrained(hf_dir)
            loaded.tokenizer.save_pretrained(hf_dir)
        run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", "f32",
             "--outfile", str(out)], capture=False, env={**os.environ, "PYTHONPATH": str(tree / "gguf-py")})
    return out


def shape_directory(root: Path, shape: str) -> Path:
    """A Hugging Face directory of `shape` (bench/big_model.py) with random
    fp32 weights and SmolLM2's tokenizer and vocabulary, written once."""
    import shutil

    from big_model import write_checkpoint
    from kvexport.exporter.sources.models import _converted_gguf, _smollm2_gguf

    directory = root / f"{shape}-hf"
    smollm2 = _converted_gguf(_smollm2_gguf(), lambda message: None)
    config = json.loads((smollm2 / "config.json").read_text())
    vocabulary = {k: config[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")}
    write_checkpoint(shape, "fp32", directory, vocabulary)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2 / name).exists():
            shutil.copyfile(smollm2 / name, directory / name)
    return directory


# kvexport's packages of a shape, by label: the flags beyond the common ones
EXPORTS = {"fp32": [], "bf16": ["--dtype", "bf16"], "8w": ["--qlinear", "8w", "--qembedding", "8w"],
           "4w": ["--qlinear", "4w", "--qembedding", "8w"], "gguf": ["--qlinear", "gguf"],
           "8w-int8x2": ["--qlinear", "8w", "--qembedding", "8w", "--qact", "int8x2"],
           "4w-int8x2": ["--qlinear", "4w", "--qembedding", "8w", "--qact", "int8x2"],
           "gguf-int8x2": ["--qlinear", "gguf", "--qact", "int8x2"],
           # the plain int8 rounding that 8w's int16 and 4w's int8-peak defaults replaced
           "8w-int8": ["--qlinear", "8w", "--qembedding", "8w", "--qact", "int8"],
           "4w-int8": ["--qlinear", "4w", "--qembedding", "8w", "--qact", "int8"]}


def exported(root: Path, source: Path, label: str, isa: str = "native") -> Path:
    """kvexport's aoti package of `source` at the precision `label`, exported
    once for kvexport's code as it is (for AVX2 code under
    ATEN_CPU_CAPABILITY=avx2, which main sets)."""
    out = root / "packages" / "-".join([source.name, label] + ([isa] if isa != "native" else []) + [code_digest()])
    if not (out / "manifest.json").exists():
        run([sys.executable, "-m", "kvexport.cli.main", "export", str(source), "--use-offgraph-kv-cache", "--backend", "aoti",
             "--forward-sizes", "1,8", "--max-step-tokens", "512", "--row-kernel", "on", *EXPORTS[label], "-o", str(out),
             "--overwrite"],
            capture=False)
        drop_older(out)
    return out


def llama_f32(model: str = "smollm2-135m") -> tuple[Path, Path]:
    """(llama.cpp's built tools, `model`'s F32 GGUF), made once in kvexport's cache
    directory: what bench/serve.py runs llama-server on."""
    root = cache_dir() / f"llama.cpp-{VERSION}"
    binaries = build(root)
    return binaries, f32_gguf(binaries, root, model)


def llama_rates(binaries: Path, gguf: Path, threads: int, passive: bool) -> dict:
    env = {**os.environ, "OMP_WAIT_POLICY": "passive"} if passive else dict(os.environ)
    bench = json.loads(run([str(binaries / "llama-bench"), "-m", str(gguf), "-t", str(threads),
                            "-p", "512", "-n", "64", "-r", "3", "-o", "json"], env=env))
    rates = {("prefill_512" if r["n_prompt"] else "decode_batch1"): round(r["avg_ts"], 1) for r in bench}
    rates["decode_8_sequences"] = round(batched_generation(binaries, gguf, threads, 24, 64, 8, env=env), 1)
    return rates


def batched_generation(binaries: Path, gguf: Path, threads: int, prompt: int, tokens: int, sequences: int,
                       **kwargs) -> float:
    """llama-batched-bench's generation tokens/s, aggregated over `sequences`
    sequences of a `prompt`-token prompt generating `tokens` each (kwargs: run's)."""
    lines = run([str(binaries / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-c", "4096", "-b", "512",
                 "-ub", "512", "-npp", str(prompt), "-ntg", str(tokens), "-npl", str(sequences), "--output-format",
                 "jsonl"], **kwargs)
    return [json.loads(line) for line in lines.splitlines() if line.startswith("{")][-1]["speed_tg"]


def ours(package: Path, model: str | None = None, weights: str = "mapped") -> dict:
    """bench/decode.py and bench/prefill.py on `package`, HF on `model` (a
    manifest records a local source by its folder's name only)."""
    def bench(script: str) -> dict:
        hf = ["--model", model] if model else []
        return json.loads(run([sys.executable, str(HERE / script), "--package", str(package), *hf, "--weights",
                               weights], cwd=HERE))

    decode, prefill = bench("decode.py"), bench("prefill.py")
    return {"decode_batch1": decode["batch1"]["package_tokens_per_s"],
            "decode_8_sequences": decode["batch8"]["package_tokens_per_s"],
            "prefill_512": prefill["package_tokens_per_s"],
            "hf_decode_batch1": decode["batch1"]["hf_generate_tokens_per_s"],
            "hf_prefill_512": prefill["hf_forward_tokens_per_s"],
            "hf_prefill_512_last_row": prefill["hf_forward_last_row_tokens_per_s"]}


# the GGUF each package precision is measured beside in turns (a label's first part: 8w-int8x2 is 8w)
TURNS_GGUF = {"fp32": "F32", "bf16": "BF16", "8w": "Q8_0", "4w": "Q4_0", "gguf": "GGUF"}


def turns(package: Path, gguf: Path, isa: str, rounds: int, threads: int, weights: str = "mapped") -> dict:
    """bench/paired_decode.py's medians for `package` beside `gguf`, at batch
    1 and over 8 sessions: each tool's median tokens/s, the median of the
    rounds' ratios, and the read rates the rounds began at."""
    out = {}
    for sessions, key in ((1, "batch1"), (8, "8_sequences")):
        paired = json.loads(run([sys.executable, str(HERE / "paired_decode.py"), "--package", str(package), "--gguf",
                                 str(gguf), "--isa", isa, "--rounds", str(rounds), "--sessions", str(sessions),
                                 "--threads", str(threads), "--weights", weights], cwd=HERE))
        reads = [r["read_gbps"] for r in paired["rounds"]]
        out[key] = {**paired["median_tokens_per_s"], "ratio": paired["median_ratio_of_rounds"],
                    "read_gbps": [min(reads), max(reads)]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--shape", help="a real-size shape from bench/big_model.py (llama3.2-1b), random weights, "
                                        "SmolLM2's tokenizer: the model both tools read, instead of --model")
    parser.add_argument("--export", default="", help="comma-separated precisions of kvexport packages to export "
                                                      f"from the model and measure ({','.join(EXPORTS)})")
    parser.add_argument("--package", action="append", default=[], help="LABEL=PKG, measured beside llama.cpp")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure everything this many times, alternating llama.cpp and the packages, and keep "
                             "each figure's best: a VM's speed drifts within minutes, and one pass compares a fast "
                             "minute with a slow one")
    parser.add_argument("--turns", type=int, default=6,
                        help="rounds of alternating decode turns per package beside llama.cpp at its precision, at "
                             "batch 1 and over 8 sessions (bench/paired_decode.py); 0 leaves them out")
    parser.add_argument("--isa", default="native", choices=sorted(ISAS),
                        help="avx2: llama.cpp built for AVX2 alone, and kvexport's packages exported and run with "
                             "ATEN_CPU_CAPABILITY=avx2 and oneDNN and MKL held to AVX2 (ISA_ENV): an AVX2 machine's "
                             "table on an AVX-512 one; avx512: both in AVX-512 with VNNI and BF16, no AMX")
    parser.add_argument("--omp-passive", action="store_true",
                        help="OMP_WAIT_POLICY=passive for llama.cpp: on a shared machine its spinning threads collapse")
    parser.add_argument("--weights", choices=WEIGHTS_MEMORY, default="mapped",
                        help="how kvexport's runtime holds each package's weights (runtime.load's `weights`)")
    args = parser.parse_args()
    os.environ.update(ISA_ENV[args.isa])  # every export and bench this script starts inherits it
    root = cache_dir() / f"llama.cpp-{VERSION}"
    binaries = build(root, args.isa)
    model = str(shape_directory(root, args.shape)) if args.shape else args.model
    result = {"cpu": cpu_model(), "isa": args.isa, "env": ISA_ENV[args.isa], "threads": args.threads, "rounds": args.rounds,
              "weights": args.weights, "model": args.shape or model, "llama.cpp": {}}
    ggufs = models(build(root), root, model)
    for label in filter(None, args.export.split(",")):
        if label not in EXPORTS or (label == "gguf" and "GGUF" not in ggufs):
            parser.error(f"--export takes {', '.join(EXPORTS)} (gguf: the built-in SmolLM2 only); got {label!r}")
        args.package.append(f"{label}={exported(root, Path(model), label, args.isa)}")
    for _ in range(args.rounds):
        for kind, gguf in ggufs.items():
            keep_best(result["llama.cpp"].setdefault(kind, {}),
                      llama_rates(binaries, gguf, args.threads, args.omp_passive))
        for item in args.package:
            label, _, path = item.partition("=")
            try:
                keep_best(result.setdefault(label, {}), ours(Path(path), model if args.shape else None, args.weights))
            except subprocess.CalledProcessError as e:  # one package failing leaves the others' figures
                result.setdefault(label, {})["error"] = f"{Path(e.cmd[1]).name} exited with {e.returncode} (its stderr is above)"
    for item in args.package if args.turns else []:
        label, _, path = item.partition("=")
        gguf = ggufs.get(TURNS_GGUF.get(label.split("-")[0], ""))
        if gguf is None:
            print(f"no turns for {label}: its precision is none of {', '.join(TURNS_GGUF)}", file=sys.stderr)
            continue
        try:
            result.setdefault(label, {})["turns"] = turns(Path(path), gguf, args.isa, args.turns, args.threads, args.weights)
        except subprocess.CalledProcessError as e:
            result.setdefault(label, {})["turns_error"] = f"paired_decode.py exited with {e.returncode} (its stderr is above)"
    emit(result)


def keep_best(best: dict, rates: dict) -> None:
    """Each rate's highest so far (every figure here is tokens/s)."""
    for key, value in rates.items():
        best[key] = max(best.get(key, value), value)


if __name__ == "__main__":
    main()
