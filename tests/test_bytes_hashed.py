"""Every byte used is a byte hashed: a file renamed into a package's folder
after its checksum was taken never runs, no remembered digest lets a changed
file pass, and a small program file cannot exhaust the machine."""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

from kvexport.contract import package as package_module
from kvexport.contract.errors import PackageError
from kvexport.contract.package import dump_manifest, sha256_file
from helpers import AOTI_MODEL
from kvexport.runtime import generate, load


def copy_of(tmp_path, source, name="pkg"):
    target = tmp_path / name
    shutil.copytree(source, target)
    return target


def fix_checksums(pkg):
    """What an attacker does after editing files: the checksums match again."""
    manifest = json.loads((pkg / "manifest.json").read_text())
    for rel in manifest["files"]:
        manifest["files"][rel] = {"sha256": sha256_file(pkg / rel), "bytes": (pkg / rel).stat().st_size}
    (pkg / "manifest.json").write_text(dump_manifest(manifest))


def swap(path, data: bytes) -> None:
    """Renames other bytes into `path`'s place, as someone who can write
    the package's folder (not the file) does."""
    staged = path.with_name(path.name + ".staged")
    staged.write_bytes(data)
    os.replace(staged, path)


def swap_after_hashing(monkeypatch, path, data: bytes) -> list[str]:
    """The race made deterministic: the original bytes are in place whenever
    the file is opened or hashed, and `data` is renamed into their place
    right after each digest of them, as an attacker who watches for the
    check does. Returns the list of swaps made (the digest function's name each)."""
    swaps: list[str] = []
    original = path.read_bytes()
    digest_of_original = hashlib.sha256(original).hexdigest()

    def restore():
        if path.read_bytes() != original:
            swap(path, original)

    def before(real):
        return lambda *args, **kwargs: (restore(), real(*args, **kwargs))[1]

    def after(real):
        def hooked(*args, **kwargs):
            restore()
            digest = real(*args, **kwargs)
            if digest == digest_of_original:
                swap(path, data)
                swaps.append(real.__name__)
            return digest

        return hooked

    for name, hook in (("open_inside", before), ("sha256_file", after), ("sha256_fd", after), ("sha256_buffer", after)):
        if hasattr(package_module, name):  # today's names, and those the old code had
            monkeypatch.setattr(package_module, name, hook(getattr(package_module, name)))
    return swaps


def tokens(runtime) -> list[int]:
    return generate(runtime, [[5, 6, 7]], 3, stop_at_eos=False)[0]


# --- portable programs and weights -------------------------------------------------------------


def test_a_program_swapped_after_load_never_runs(tmp_path, tiny_package):
    pkg = copy_of(tmp_path, tiny_package("tiny-llama"))
    expected = tokens(load(tiny_package("tiny-llama")))
    runtime = load(pkg)  # hashed here; forward_1 is built on first use
    for method in ("forward_1", "forward_4"):
        swap(pkg / "programs" / f"{method}.json.gz", (pkg / "programs" / "sample_argmax.json.gz").read_bytes())
    assert tokens(runtime) == expected


@pytest.mark.parametrize("memory", ["mapped", "private"])
def test_weights_swapped_after_hashing_never_load(tmp_path, tiny_package, monkeypatch, memory):
    pkg = copy_of(tmp_path, tiny_package("tiny-llama"))
    weights = pkg / "weights.safetensors"
    original = weights.read_bytes()
    header = 8 + int.from_bytes(original[:8], "little")
    swap_after_hashing(monkeypatch, weights, original[:header] + bytes(len(original) - header))  # every weight 0
    runtime = load(pkg, weights=memory)
    assert (weights.read_bytes() != original), "the swap happened"
    reference = load(tiny_package("tiny-llama"))
    assert all(torch.equal(t, reference.package.tensors[k]) for k, t in runtime.package.tensors.items())
    assert tokens(runtime) == tokens(reference)


def test_weights_are_views_of_one_private_mapping(tmp_path, tiny_package):
    """Zero-copy, shared by every method, and a write through a tensor never
    reaches the file (MAP_PRIVATE)."""
    pkg = copy_of(tmp_path, tiny_package("tiny-llama"))
    before = (pkg / "weights.safetensors").read_bytes()
    runtime = load(pkg)
    tokens(runtime)
    package = runtime.package
    embed = package.tensors["decoder.embed_tokens.weight"]
    assert package._parameter("forward_1", "lm_head.weight").data_ptr() == embed.data_ptr()
    embed.zero_()
    assert (pkg / "weights.safetensors").read_bytes() == before


def zero_in_place(weights) -> None:
    """Writes zeros over every weight of the file, in place: the same inode,
    the same pages (what someone who can write the file does after a load)."""
    original = weights.read_bytes()
    header = 8 + int.from_bytes(original[:8], "little")
    with open(weights, "r+b") as f:
        f.seek(header)
        f.write(bytes(len(original) - header))


def mapping_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(a, 16) for a in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_private_weights_are_a_copy_on_huge_pages(tmp_path, tiny_package):
    """`weights="private"` copies the weights into this process's memory,
    advised onto transparent huge pages (VmFlags "hg") where the kernel has
    them: the same tokens as the mapping, and a write into the file in place
    after the load reaches the mapping, never the copy."""
    pkg = copy_of(tmp_path, tiny_package("tiny-llama"))
    weights = pkg / "weights.safetensors"
    weights.chmod(0o644)  # only this user writes it, whatever the umask: mapped, not copied
    mapped, private = load(pkg), load(pkg, weights="private")
    assert tokens(private) == tokens(mapped)
    address = next(iter(private.package.tensors.values())).data_ptr()
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        assert "hg" in mapping_flags(address)
    assert "hg" not in mapping_flags(next(iter(mapped.package.tensors.values())).data_ptr())
    before = {k: t.clone() for k, t in private.package.tensors.items()}
    zero_in_place(weights)
    assert all(torch.equal(t, before[k]) for k, t in private.package.tensors.items())
    assert any(not torch.equal(t, before[k]) for k, t in mapped.package.tensors.items()), "the write reached the file"


def test_private_weights_that_do_not_fit_are_refused(tmp_path, tiny_package, monkeypatch):
    pkg = copy_of(tmp_path, tiny_package("tiny-llama"))
    weights = pkg / "weights.safetensors"
    weights.chmod(0o644)
    monkeypatch.setattr(package_module, "available_memory", lambda: 1000)
    with pytest.raises(PackageError, match=r"asked for in private memory.*do not fit.*: map it .*--weights mapped\)$"):
        load(pkg, weights="private")
    load(pkg)  # mapped: no copy, no memory asked for
    weights.chmod(0o664)  # others can write it too: both fixes named
    with pytest.raises(PackageError, match=r"can be written by others.*--weights mapped\) and make it writable by you"):
        load(pkg, weights="private")
    with pytest.raises(ValueError, match="mapped, private, auto"):
        load(pkg, weights="huge")


def test_auto_copies_weights_that_fit_easily_and_maps_the_rest(tmp_path, tiny_package, monkeypatch):
    """`weights="auto"` copies the weights where they take at most half the
    memory available (AUTO_PRIVATE_SHARE) and maps them otherwise, never
    refusing; the reader says which it did."""
    pkg = copy_of(tmp_path, tiny_package("tiny-llama"))
    weights = pkg / "weights.safetensors"
    weights.chmod(0o644)
    size = weights.stat().st_size
    assert package_module.AUTO_PRIVATE_SHARE == 0.5
    for free, want in ((2 * size, "private"), (2 * size - 1, "mapped"), (None, "mapped")):
        monkeypatch.setattr(package_module, "available_memory", lambda free=free: free)
        runtime = load(pkg, weights="auto")
        assert runtime.package.reader.holding == {"weights.safetensors": want}, free
        if want == "private" and os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
            assert "hg" in mapping_flags(next(iter(runtime.package.tensors.values())).data_ptr())
    assert tokens(load(pkg, weights="auto")) == tokens(load(pkg))
    assert load(pkg).package.reader.holding == {"weights.safetensors": "mapped"}


@pytest.mark.parametrize("mode", [0o644, 0o664, "another owner"])
def test_weights_others_can_write_are_copied_while_hashed(tmp_path, tiny_package, mode):
    """A private mapping shows the file's later writes in every page not yet
    read, so whoever else can write the weights file could change weights
    after their hash. Such a file (group- or world-writable, or owned by
    another user) is read into anonymous memory instead: writing the file
    in place after `load` changes nothing then; a file only this user can
    write stays a zero-copy mapping."""
    pkg = copy_of(tmp_path, tiny_package("tiny-llama"))
    weights = pkg / "weights.safetensors"
    if mode == "another owner":
        if os.getuid() != 0:
            pytest.skip("only root can give a file to another user")
        os.chown(weights, 4242, -1)  # mode 0644: its owner can still write it
    else:
        weights.chmod(mode)
    runtime = load(pkg)
    before = {k: t.clone() for k, t in runtime.package.tensors.items()}
    zero_in_place(weights)
    changed = [k for k, t in runtime.package.tensors.items() if not torch.equal(t, before[k])]
    if mode != 0o644:
        assert changed == []
    else:
        assert changed, "a mapping of a file only this user writes is zero-copy: it sees the write"


def test_mapped_weights_are_what_safetensors_reads_for_every_dtype(tmp_path):
    from safetensors.torch import load_file, save_file

    from kvexport.contract.confined_io import map_fd
    from kvexport.contract.safetensors_io import map_tensors

    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16), "f16": torch.randn(7).half(), "f64": torch.randn(2, 2, dtype=torch.float64),
        "f8": torch.randn(4, 4).to(torch.float8_e4m3fn), "bool": torch.tensor([True, False, True]),
        "u16": torch.tensor([1, 60000], dtype=torch.int32).to(torch.uint16), "i8": torch.arange(-3, 3, dtype=torch.int8),
        "i64": torch.arange(3), "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    fd = os.open(path, os.O_RDONLY)
    mapped = map_tensors(map_fd(fd, os.fstat(fd).st_size), path)
    os.close(fd)
    for name, want in load_file(str(path)).items():
        got = mapped[name]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        assert got.reshape(-1).view(torch.uint8).tolist() == want.reshape(-1).view(torch.uint8).tolist(), name


def test_a_fifo_planted_after_listing_is_refused_not_waited_on(tmp_path, tiny_package):
    """Opening a FIFO blocks until someone writes it: one planted after the
    package was listed is refused (it used to hang the reader)."""
    pkg = copy_of(tmp_path, tiny_package("tiny-llama"))
    reader = package_module.PackageReader(pkg)
    program = pkg / "programs" / "forward_1.json.gz"
    program.unlink()
    os.mkfifo(program)
    with pytest.raises(PackageError, match="not a regular file"):
        reader.program_json("forward_1")


def test_a_planted_digest_stamp_never_passes_a_changed_file(tmp_path, tiny_package, monkeypatch):
    """The old memo trusted a stamp in the cache keyed by the file's stat;
    whoever could write the cache passed any file. Digests are taken afresh."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVEXPORT_CACHE_DIR", str(cache))
    monkeypatch.setattr(package_module, "REMEMBERED_DIGEST_BYTES", 1, raising=False)
    pkg = copy_of(tmp_path, tiny_package("tiny-llama"))
    weights = pkg / "weights.safetensors"
    listed = json.loads((pkg / "manifest.json").read_text())["files"]["weights.safetensors"]["sha256"]
    with open(weights, "r+b") as f:  # the last weight byte changes in place
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    st = os.stat(weights)
    key = f"{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
    name = hashlib.sha256(key.encode()).hexdigest()
    stamp = cache / "digests" / name[:2] / name
    stamp.parent.mkdir(parents=True)
    stamp.write_text(listed)
    later = (st.st_ctime_ns + 10**10) // 10**9
    os.utime(stamp, (later, later))
    with pytest.raises(PackageError, match="checksum differs"):
        load(pkg)


def test_hashing_remembers_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEXPORT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(package_module, "REMEMBERED_DIGEST_BYTES", 1, raising=False)  # the old memo's threshold
    path = tmp_path / "big.bin"
    path.write_bytes(b"a" * 1000)
    assert sha256_file(path) == hashlib.sha256(b"a" * 1000).hexdigest()
    assert not (tmp_path / "cache").exists()


# --- bounded decompression and JSON ---------------------------------------------------------------


def gzip_bomb() -> bytes:
    """1 MB of gzip that unpacks to 1 GiB of JSON, ~358 M objects: gzip
    members end to end, so it is built in a fraction of a second."""
    body = gzip.compress(b"{}," * (1 << 20), 9)
    return gzip.compress(b"[") + body * 341 + gzip.compress(b"{}]")


VALIDATE = "r = validate_package(pkg); print(render(r)); sys.exit(0 if r.ok else 1)"
FIRST_USE = "runtime = load(pkg)\ntry:\n    runtime.package.method('forward_1')\nexcept PackageError as e:\n    print(e); sys.exit(1)"
PREAMBLE = (
    "import sys\nfrom kvexport.contract.validate import validate_package, render\n"
    "from kvexport.runtime import load, PackageError\npkg = sys.argv[1]\n"
)
BOMB_ROOM = 1536 << 20  # what the bomb gets on top of the child's own imports; it used to take ~30 GB


@functools.cache
def memory_limit() -> int:
    """The child's address space after its imports (torch's libraries: ~0.75
    GB for the CPU build here, several GB for a CUDA build) plus BOMB_ROOM."""
    peak = "print(next(l for l in open('/proc/self/status') if l.startswith('VmPeak')).split()[1])"
    kb = subprocess.run([sys.executable, "-c", PREAMBLE + peak, "."], capture_output=True, text=True, check=True).stdout
    return int(kb) * 1024 + BOMB_ROOM


def run_bounded(snippet: str, pkg) -> subprocess.CompletedProcess:
    """`snippet` in a child whose address space is capped: a bomb that got
    through would end it with a MemoryError, not exhaust the machine."""
    limit = memory_limit()
    return subprocess.run(
        [sys.executable, "-c", PREAMBLE + snippet, str(pkg)], capture_output=True, text=True, timeout=180,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
    )


@pytest.mark.parametrize("snippet", [VALIDATE, FIRST_USE], ids=["validate", "load"])
def test_a_gzip_bomb_is_refused_in_bounded_memory(tmp_path, tiny_package, snippet):
    pkg = copy_of(tmp_path, tiny_package("tiny-llama"))
    (pkg / "programs" / "forward_1.json.gz").write_bytes(gzip_bomb())
    fix_checksums(pkg)
    result = run_bounded(snippet, pkg)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "methods.forward_1.program" in result.stdout and "gzip bomb" in result.stdout


def test_json_values_are_counted_before_parsing(tmp_path, tiny_package, monkeypatch):
    """Within the byte caps a dense JSON file still holds millions of
    objects: their count is bounded from the raw bytes, before json.loads."""
    from kvexport.contract import confined_io

    monkeypatch.setattr(confined_io, "MAX_PROGRAM_VALUES", 1000)
    pkg = copy_of(tmp_path, tiny_package("tiny-llama"))
    (pkg / "programs" / "forward_1.json.gz").write_bytes(gzip.compress(b"[" + b"[]," * 2000 + b"[]]"))
    reader = package_module.PackageReader(pkg)
    monkeypatch.setattr(json, "loads", lambda *a, **k: pytest.fail("parsed before it was counted"))
    with pytest.raises(PackageError, match="JSON values"):
        reader.program_json("forward_1")


# --- compiled archives (aoti) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def aoti_package(tiny_package):
    return tiny_package(AOTI_MODEL, "aoti")


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """A fresh TMPDIR, for Python and for torch's C++ loader."""
    folder = tmp_path / "tmpdir"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr("tempfile.tempdir", None)
    return folder


@pytest.mark.compile
def test_a_compiled_archive_swapped_after_hashing_never_loads(tmp_path, aoti_package, monkeypatch, private_tmp):
    want = tokens(load(aoti_package))  # before the hooks, which watch every open and digest
    pkg = copy_of(tmp_path, aoti_package)
    archive = pkg / "programs" / "forward_4.aoti.pt2"
    swaps = swap_after_hashing(monkeypatch, archive, b"PK\x05\x06" + bytes(18))  # an empty zip: loading it fails
    runtime = load(pkg)
    hashed_at_load = len(swaps)
    assert tokens(runtime) == want
    assert hashed_at_load >= 1 and len(swaps) > hashed_at_load, "swapped after the load's hash and the copy's: the copy ran"
    assert list(private_tmp.iterdir()) == []


@pytest.mark.compile
def test_a_compiled_library_that_fails_to_load_is_a_package_error(tmp_path, aoti_package, private_tmp):
    """A trusted archive whose library does not load: a PackageError naming
    the method, and nothing torch unpacked is left in the temp dir."""
    pkg = copy_of(tmp_path, aoti_package)
    archive = pkg / "programs" / "forward_4.aoti.pt2"
    out = io.BytesIO()
    with zipfile.ZipFile(archive) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, b"\x7fELF not a library" if info.filename.endswith(".so") else data)
    archive.write_bytes(out.getvalue())
    fix_checksums(pkg)
    runtime = load(pkg, trust_native_code=True)
    with pytest.raises(PackageError, match="methods.forward_4.compiled: the compiled library"):
        runtime.package.method("forward_4")
    assert list(private_tmp.iterdir()) == []
