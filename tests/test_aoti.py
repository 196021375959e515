"""The AOTInductor backend: compile target, refusals, checksums before native
code, no pickle. (Every token test runs on aoti packages too: see the
`backend` fixture.)"""

from __future__ import annotations

import json
import pickle
import re
import shutil

import pytest
import torch
from click.testing import CliRunner

from helpers import AOTI_MODEL, prompt_of
from kvexport.cli.main import main
from kvexport.runtime import PackageError, generate, load
from kvexport.contract.validate import validate_package

pytestmark = pytest.mark.compile  # every test here compiles or loads an aoti package


@pytest.fixture(scope="module")
def aoti_package(tiny_package):
    return tiny_package(AOTI_MODEL, "aoti")


def copy_with(tmp_path, source, edit=None):
    target = tmp_path / "pkg"
    shutil.copytree(source, target)
    if edit:
        manifest = json.loads((target / "manifest.json").read_text())
        edit(manifest)
        (target / "manifest.json").write_text(json.dumps(manifest, sort_keys=True))
    return target


def test_manifest_records_the_compile_target(aoti_package):
    manifest = json.loads((aoti_package / "manifest.json").read_text())
    target = manifest["backend"]["target"]
    assert manifest["backend"]["id"] == "aoti"
    assert target["device"] == "cpu" and target["torch"] == torch.__version__ and target["cpu_isa"]
    for name, entry in manifest["methods"].items():
        assert entry["compiled"] == f"programs/{name}.aoti.pt2"
        assert entry["compiled"] in manifest["files"]
    # the weights are in the weights file once, not in the compiled methods
    import zipfile

    for entry in manifest["methods"].values():
        archive = zipfile.ZipFile(aoti_package / entry["compiled"])
        names = archive.namelist()
        assert any(n.endswith(".so") for n in names)
        assert not [n for n in names if "/constants/" in n or "/weights/" in n]
        # the generated sources are emptied (their names stay: torch 2.11's loader looks up by them)
        assert not [i.filename for i in archive.infolist() if i.filename.endswith(".cpp") and i.file_size]
        # and the library deflated
        library = next(i for i in archive.infolist() if i.filename.endswith(".so"))
        assert library.compress_type == zipfile.ZIP_DEFLATED and library.compress_size < library.file_size / 2


def test_static_methods_carry_the_row_kernel(aoti_package):
    """fp32 products and attention over a static row count run on kvexport's
    kernels linked into the method's own library; the stored program stays
    plain aten."""
    import gzip
    import zipfile

    from kvexport.partitioners.aoti.kernels import build as row_kernel

    if not row_kernel.supported():
        pytest.skip("the row kernel needs x86 with AVX2 or AVX-512")
    manifest = json.loads((aoti_package / "manifest.json").read_text())
    assert manifest["backend"]["target"]["fp32_kernel_rows"] == list(range(1, 17))
    assert manifest["backend"]["target"]["attention_kernel_rows"] == list(range(1, 17))
    for name, entry in manifest["methods"].items():
        with zipfile.ZipFile(aoti_package / entry["compiled"]) as archive:
            library = b"".join(archive.read(n) for n in archive.namelist() if n.endswith(".so"))
        # forward_others links the kernels for attention (its shim takes one session's causal slice); the
        # library holds every shim then, so only the samplers show that a method links none
        forward = name.startswith("forward_")
        assert (b"kvexport_rows_linear" in library) == forward, name
        assert (b"kvexport_masked_attention" in library) == forward, name
        program = gzip.decompress((aoti_package / entry["program"]).read_bytes())
        assert b"rows_linear" not in program and b"masked_attention" not in program


@pytest.mark.parametrize(
    "key,value,needs",
    [("torch", "2.0.0", "torch 2.0.0"), ("cpu_isa", "avx1024", "CPU instructions avx1024"), ("device", "cuda", None)],
)
def test_refused_on_a_machine_that_cannot_run_it(tmp_path, aoti_package, key, value, needs):
    if key == "device" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    target = copy_with(tmp_path, aoti_package, lambda m: m["backend"]["target"].update({key: value}))
    with pytest.raises(PackageError, match="this package was compiled for .*; this machine has") as error:
        load(target)
    assert (needs or "a CUDA GPU") in str(error.value)


def test_checksums_before_native_code(tmp_path, aoti_package, monkeypatch):
    target = copy_with(tmp_path, aoti_package)
    with open(target / "programs" / "forward_4.aoti.pt2", "r+b") as f:
        f.seek(200)
        f.write(b"\0" * 16)

    def never(*args, **kwargs):
        raise AssertionError("native code loaded")

    monkeypatch.setattr(torch._inductor, "aoti_load_package", never)
    with pytest.raises(PackageError, match="forward_4.aoti.pt2: checksum"):
        load(target, verify=False)  # compiled packages are always verified


def test_inspect_and_validate_never_load_native_code(aoti_package, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("native code loaded")

    monkeypatch.setattr(torch._inductor, "aoti_load_package", never)
    assert validate_package(aoti_package).ok
    result = CliRunner().invoke(main, ["inspect", str(aoti_package)])
    assert result.exit_code == 0 and "aoti" in result.stdout


def test_loading_never_unpickles(aoti_package, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("unpickling during load")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    runtime = load(aoti_package)
    assert len(generate(runtime, [prompt_of(9, seed=2)], 5, stop_at_eos=False)[0]) == 5


def test_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = CliRunner().invoke(
        main, ["export", "tiny-llama", "-o", str(tmp_path / "p"), "--use-offgraph-kv-cache", "--backend", "aoti", "--device", "cuda"]
    )
    assert result.exit_code == 1
    assert "--device cuda needs a CUDA GPU" in result.stderr
    assert not (tmp_path / "p").exists()


def compile_job(package, method, output, **changes):
    """The job that compiled `method` of `package`, writing to `output`."""
    from dataclasses import replace

    from kvexport.partitioners.aoti.compile import CompileJob
    from kvexport.partitioners.aoti.kernels.build import archive_dir

    manifest = json.loads((package / "manifest.json").read_text())
    target = manifest["backend"]["target"]
    entry, rows, packed = manifest["methods"][method], tuple(target["fp32_kernel_rows"]), tuple(target["packed_kernel_rows"])
    job = CompileJob(method, package / entry["program"], package / "weights.safetensors", entry["weights"],
                     manifest["weights"].get("aliases", {}), entry["inputs"], output, "cpu", tuple(entry.get("state", [])),
                     rows, archive_dir() if rows or packed else None, packed,
                     attention_rows=tuple(target["attention_kernel_rows"]))
    return replace(job, **changes)


def test_a_method_compiles_to_identical_bytes(tmp_path, aoti_package):
    """The compiled code too: AOTInductor writes its compile directory into
    the code, and each method compiles in a directory fixed by its name. One
    method compiled again from the package's own files gives the bytes the
    export stored (a whole re-export proves no more)."""
    from kvexport.partitioners.aoti.compile import compile_one

    job = compile_job(aoti_package, "forward_4", tmp_path / "forward_4.aoti.pt2")
    assert compile_one(job)[3]  # in its fixed directory
    assert job.output.read_bytes() == (aoti_package / "programs/forward_4.aoti.pt2").read_bytes()


def test_the_compile_cache_gives_the_bytes_a_compile_gives(tmp_path, aoti_package):
    """The session's export kept its methods (conftest's compile cache): a
    compile of the same job is a copy of them; damaged ones compile again."""
    from dataclasses import replace

    from kvexport.partitioners.aoti import compile_cache
    from kvexport.partitioners.aoti.compile import compile_methods, configs_of

    lines = []
    jobs = [compile_job(aoti_package, m, tmp_path / f"{m}.aoti.pt2") for m in ("forward_others", "sample_argmax")]
    compile_methods(jobs, 1, lines.append)
    assert lines[-1] == "all 2 methods from the compile cache (KVEXPORT_COMPILE_CACHE=off compiles them)", lines
    for job in jobs:
        assert job.output.read_bytes() == (aoti_package / f"programs/{job.method}.aoti.pt2").read_bytes()

    exported = replace(jobs[1], threads=torch.get_num_threads())  # as compile_methods keys it
    kept = compile_cache.folder() / f"{compile_cache.key(exported, configs_of(exported))}.pt2"
    kept.write_bytes(kept.read_bytes()[:-1] + b"x")
    lines.clear()
    compile_methods(jobs[1:], 1, lines.append)
    assert re.search(r"^\[1/1\] sample_argmax compiled in [0-9.]+ s$", lines[0]), lines
    assert jobs[1].output.read_bytes() == (aoti_package / "programs/sample_argmax.aoti.pt2").read_bytes()
    assert compile_cache.fetch(compile_cache.folder(), kept.stem, tmp_path / "again.pt2") is not None  # kept anew


def test_the_compile_cache_key_covers_what_the_bytes_depend_on(tmp_path, aoti_package):
    """A parameter's values never reach the code (a compile sees stand-ins):
    the key ignores them. Buffers and constants may be folded in, the
    kernels' rows decide what the code calls: the key covers both."""
    from kvexport.contract.safetensors_io import read_header
    from kvexport.partitioners.aoti.compile_cache import key
    from kvexport.partitioners.aoti.compile import configs_of

    def key_of(job):
        return key(job, configs_of(job))

    job = compile_job(aoti_package, "forward_4", tmp_path / "out.pt2")
    base = key_of(job)
    assert key_of(compile_job(aoti_package, "forward_4", tmp_path / "elsewhere.pt2")) == base
    assert key_of(compile_job(aoti_package, "forward_4", tmp_path / "out.pt2", kernel_rows=(1, 2))) != base

    ranges, _ = read_header(job.weights)
    parameter = next(r for n, r in ranges.items() if n in job.bindings["parameters"])
    buffer = next(r for n, r in ranges.items() if n in job.bindings["buffers"] + job.bindings["constants"])
    for stored, same in ((parameter, True), (buffer, False)):
        weights = bytearray(job.weights.read_bytes())
        weights[stored.offset] ^= 0xFF
        changed = tmp_path / f"{stored.name}.safetensors"
        changed.write_bytes(bytes(weights))
        assert (key_of(compile_job(aoti_package, "forward_4", job.output, weights=changed)) == base) is same, stored.name


def test_bf16_products_run_on_the_row_kernel(tiny_package):
    """A bf16 package's static methods multiply on the row kernel reading bf16
    weights (its export verified the model's own tokens alone and batched);
    batched equals alone."""
    import re

    from helpers import PROGRESS
    from kvexport.partitioners.aoti.kernels import build

    if not build.supported():
        pytest.skip("the row kernel needs x86 with AVX2 or AVX-512")
    path = tiny_package("tiny-llama", "aoti", dtype="bf16")
    assert re.search(r"forward_4 compiled in [0-9.]+ s, calling kvexport's .*rows_linear x[1-9]", "\n".join(PROGRESS[str(path)]))
    prompts = [prompt_of(3, seed=7), prompt_of(9, seed=8), prompt_of(26, seed=9)]
    runtime = load(path)
    assert generate(runtime, prompts, 8) == [generate(load(path), [p], 8)[0] for p in prompts]


@pytest.mark.parametrize("dtype,row_kernel,products,attention", [
    ("fp32", "auto", (3, 4), (1, 2, 3, 4)),  # the probe's choice for products; attention at every count
    ("bf16", "auto", (1, 2, 3, 4), (1, 2, 3, 4)),  # bf16 products at every count too
    ("fp32", "on", (1, 2, 3, 4), (1, 2, 3, 4)),
    ("fp32", "off", (), ()),
])
def test_the_probe_chooses_fp32_products_only(monkeypatch, dtype, row_kernel, products, attention):
    """The kernel probe times fp32 products against the BLAS: it decides
    those, not bf16 products (on the kernel at every row count) nor
    attention (on the masked attention kernel at every row count unless
    --row-kernel off)."""
    from kvexport.exporter.spec import ExportSpec
    from kvexport.partitioners import aoti
    from kvexport.partitioners.aoti.kernels import build, probe

    probed = {"auto": (3, 4), "on": (1, 2, 3, 4), "off": ()}
    monkeypatch.setattr(probe, "kernel_rows", lambda device, mode: probed[mode])
    monkeypatch.setattr(probe, "packed_rows", lambda device, mode: ())
    monkeypatch.setattr(build, "archive_dir", lambda: None)
    options = aoti._configure(ExportSpec(backend="aoti", dtype=dtype, row_kernel=row_kernel))
    assert (options.kernel_rows, options.attention_rows) == (products, attention)


def test_a_compile_failure_in_a_worker_crosses_as_its_message(monkeypatch, tmp_path):
    """An inductor error can hold frames, which do not pickle: the worker
    sends what went wrong as text, never "cannot pickle 'frame' object"."""
    import sys

    from kvexport.contract.errors import ExportError
    from kvexport.partitioners.aoti import compile as aoti_compile

    class Unpicklable(RuntimeError):
        def __init__(self, message):
            super().__init__(message)
            self.frame = sys._getframe()

    def fails(job):
        raise Unpicklable("Error in codegen for ComputedBuffer(name='buf12')")

    monkeypatch.setattr(aoti_compile, "compile_one", fails)
    job = aoti_compile.CompileJob("sample", tmp_path / "g", tmp_path / "w", {}, {}, [], tmp_path / "out")
    with pytest.raises(ExportError) as raised:
        aoti_compile._compile_in_worker(job)
    crossed = pickle.loads(pickle.dumps(raised.value))
    assert str(crossed) == "AOTInductor compile of sample failed: Unpicklable: Error in codegen for ComputedBuffer(name='buf12')"
