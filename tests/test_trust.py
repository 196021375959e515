"""The trust decision for native code: an aoti package loads only when its
manifest digest is in the trust store (exported here, or `kvexport trust`),
or with trust_native_code, or when it equals expect_digest."""

from __future__ import annotations

import json
import os
import shutil
import stat

import pytest
import torch
from click.testing import CliRunner

from helpers import AOTI_MODEL
from kvexport.cli.main import main
from kvexport.runtime import PackageError, generate, load
from kvexport.contract.package import dump_manifest, sha256_file
from kvexport.contract.trust import manifest_digest, package_digest, store_path, trust_dir
from kvexport.contract.validate import validate_package

REFUSED = "holds native code compiled by someone else"

pytestmark = pytest.mark.compile  # the trust decision is about an aoti package's native code


@pytest.fixture(scope="module")
def aoti_package(tiny_package):
    return tiny_package(AOTI_MODEL, "aoti")


@pytest.fixture
def empty_store(tmp_path, monkeypatch):
    path = tmp_path / "trust"
    monkeypatch.setenv("KVEXPORT_TRUST_DIR", str(path))
    return path


def never_load_native_code(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("native code loaded")

    monkeypatch.setattr(torch._inductor, "aoti_load_package", never)


def runs(runtime) -> bool:
    """Loading is lazy: a step is what loads the compiled methods."""
    return len(generate(runtime, [[5, 6, 7]], 2, stop_at_eos=False)[0]) == 2


def run_cli(*args: str):
    return CliRunner().invoke(main, list(args))


def test_exported_package_is_trusted(aoti_package, session_trust_dir):
    digest = package_digest(aoti_package)
    assert digest == manifest_digest((aoti_package / "manifest.json").read_bytes())
    stored = json.loads((session_trust_dir / "trusted.json").read_text())
    assert stored["trusted"][digest]["path"] == str(aoti_package.absolute()) and stored["trusted"][digest]["added_utc"]
    assert stat.S_IMODE(os.stat(session_trust_dir / "trusted.json").st_mode) == 0o600
    assert runs(load(aoti_package))


def test_untrusted_is_refused_with_the_ways_to_trust_it(aoti_package, empty_store, monkeypatch):
    never_load_native_code(monkeypatch)
    with pytest.raises(PackageError, match=REFUSED) as error:
        load(aoti_package)
    message = str(error.value)
    for needed in (package_digest(aoti_package), f"kvexport trust {aoti_package}", "--trust-native-code", "--expect-digest"):
        assert needed in message
    # inspecting and validating need no trust: they never load native code
    assert validate_package(aoti_package).ok
    assert run_cli("inspect", str(aoti_package)).exit_code == 0


def test_trust_native_code_loads_without_recording(aoti_package, empty_store):
    assert runs(load(aoti_package, trust_native_code=True))
    assert not store_path().exists()


def test_kvexport_trust_then_load_then_remove(aoti_package, empty_store):
    digest = package_digest(aoti_package)
    result = run_cli("trust", str(aoti_package))
    assert result.exit_code == 0 and digest in result.stdout
    assert runs(load(aoti_package))
    assert run_cli("trust", "--remove", str(aoti_package)).exit_code == 0
    with pytest.raises(PackageError, match=REFUSED):
        load(aoti_package)
    result = run_cli("trust", "--remove", str(aoti_package))
    assert result.exit_code == 0 and "was not trusted" in result.stdout


def swapped_copy(tmp_path, source):
    """A copy whose forward_4 is another method's compiled code, with the
    manifest's checksums fixed up: whole, but not what was trusted."""
    target = tmp_path / "pkg"
    shutil.copytree(source, target)
    rel = "programs/forward_4.aoti.pt2"
    shutil.copyfile(target / "programs" / "forward_others.aoti.pt2", target / rel)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["files"][rel] = {"sha256": sha256_file(target / rel), "bytes": (target / rel).stat().st_size}
    (target / "manifest.json").write_text(dump_manifest(manifest))
    return target


def test_a_tampered_copy_of_a_trusted_package_is_refused(tmp_path, aoti_package, monkeypatch):
    target = swapped_copy(tmp_path, aoti_package)
    assert validate_package(target).ok  # the checksums hold: they prove integrity, not origin
    never_load_native_code(monkeypatch)
    with pytest.raises(PackageError, match=REFUSED):
        load(target)


def test_expect_digest_pins_any_package(tiny_package, aoti_package, empty_store):
    with pytest.raises(PackageError, match="is not the expected 0+; this is not the package that was pinned"):
        load(aoti_package, expect_digest="0" * 64)
    assert runs(load(aoti_package, expect_digest=package_digest(aoti_package).upper()))
    portable = tiny_package("tiny-llama")
    assert runs(load(portable))  # data: no trust needed
    with pytest.raises(PackageError, match="this is not the package that was pinned"):
        load(portable, expect_digest=package_digest(aoti_package))
    assert runs(load(portable, expect_digest=package_digest(portable)))


def test_a_pin_refuses_even_a_trusted_package(aoti_package):
    with pytest.raises(PackageError, match="this is not the package that was pinned"):
        load(aoti_package, expect_digest="0" * 64)


def test_compiled_code_needs_the_aoti_backend(tmp_path, aoti_package, monkeypatch):
    """Declaring the package portable does not skip the trust decision."""
    target = tmp_path / "pkg"
    shutil.copytree(aoti_package, target)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["backend"] = {"id": "portable"}
    (target / "manifest.json").write_text(dump_manifest(manifest))
    never_load_native_code(monkeypatch)
    with pytest.raises(PackageError, match="only a package whose backend declares a compile target (may hold|holds) compiled code"):
        load(target).package.method("forward_4")


def test_cli_exit_codes(tmp_path, aoti_package, empty_store):
    gen = ["generate", str(aoti_package), "--prompt-ids", "5,6,7", "--max-new-tokens", "2"]
    refused = run_cli(*gen)
    assert refused.exit_code == 1 and REFUSED in refused.stderr and len(refused.stderr.splitlines()) == 1
    assert run_cli(*gen, "--trust-native-code").exit_code == 0
    assert run_cli(*gen, "--expect-digest", "0" * 64).exit_code == 1
    digest = run_cli("digest", str(aoti_package))
    assert digest.exit_code == 0 and digest.stdout.strip() == package_digest(aoti_package)
    assert run_cli(*gen, "--expect-digest", digest.stdout.strip()).exit_code == 0
    damaged = tmp_path / "damaged"
    shutil.copytree(aoti_package, damaged)
    with open(damaged / "programs" / "forward_4.aoti.pt2", "r+b") as f:
        f.write(b"\0" * 16)
    result = run_cli("trust", str(damaged))
    assert result.exit_code == 1 and "damaged; not trusting it" in result.stderr
    assert not store_path().exists()
    assert run_cli("trust", str(tmp_path / "nowhere")).exit_code == 1


def test_trust_dir_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv("KVEXPORT_TRUST_DIR")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert trust_dir() == tmp_path / "xdg" / "kvexport"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert trust_dir() == tmp_path / "home" / ".config" / "kvexport"


def test_a_damaged_store_is_a_clear_error(aoti_package, empty_store):
    empty_store.mkdir()
    (empty_store / "trusted.json").write_text("{not json")
    result = run_cli("generate", str(aoti_package), "--prompt-ids", "5", "--max-new-tokens", "1")
    assert result.exit_code == 1 and "cannot read the trust store" in result.stderr
