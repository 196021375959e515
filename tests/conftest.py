"""Shared fixtures: tiny packages are exported once per test session.

The suite runs on two pytest-xdist workers (pyproject's addopts; `-n0`
runs it in one process). Every test that compiles native code runs on one
worker (the `compile` group: one compile directory, one trust store, aoti
packages exported once), every other module's tests on one worker (its
module-scoped fixtures run once), and portable packages are shared between
the workers through a locked folder, so no package is exported twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from helpers import export_tiny
from kvexport.exporter.sources.models import load_model
from kvexport.runtime import OffgraphKVManager, load


WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER is not None:
    torch.set_num_threads(1)  # two workers on two cores: one thread each, not two fighting for one core


GROUPS_FILE = "KVEXPORT_TEST_GROUPS"  # where a worker writes each test's group for the controller's scheduler


def test_group(item) -> str:
    """`compile` for every test that compiles, else the test's module."""
    return "compile" if item.get_closest_marker("compile") else item.module.__name__


def pytest_configure(config):
    if WORKER is None and getattr(config.option, "numprocesses", None):
        fd, path = tempfile.mkstemp(prefix="kvexport-test-groups-", suffix=".json")
        os.close(fd)
        os.environ[GROUPS_FILE] = path  # the workers, started after this, inherit it


def pytest_unconfigure(config):
    if WORKER is None and os.environ.get(GROUPS_FILE):
        Path(os.environ.pop(GROUPS_FILE)).unlink(missing_ok=True)


def pytest_collection_modifyitems(config, items):
    """The compile group and the slow modules go first, so the longest units
    start at once; the first worker tells the controller each test's group."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("compile") else 1 if item.get_closest_marker("slow") else 2)
    if WORKER == "gw0" and os.environ.get(GROUPS_FILE):
        Path(os.environ[GROUPS_FILE]).write_text(json.dumps({item.nodeid: test_group(item) for item in items}))


def pytest_xdist_make_scheduler(config, log):
    """Whole groups to one worker each (xdist's own loadgroup cannot tag
    nodeids under this pytest): a group's module-scoped fixtures run once."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def __init__(self, config, log=None):
            super().__init__(config, log)
            # xdist orders groups by test count unless told not to: that sent
            # the SmolLM2 module (six tests, two minutes) last, alone on one
            # worker; the collection's order (the longest groups first) is kept
            self.config.option.loadscopereorder = False

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                path = Path(os.environ.get(GROUPS_FILE, ""))
                self.groups = json.loads(path.read_text() or "{}") if path.is_file() else {}
            return self.groups.get(nodeid) or nodeid.split("::")[0]

    return GroupScheduling(config, log)


def shared_folder(tmp_path_factory):
    """A folder both workers see (the session's base folder without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if WORKER is not None else base


@pytest.fixture(scope="session", autouse=True)
def session_trust_dir(tmp_path_factory):
    """One trust store for the session, never the user's: the aoti packages
    exported here are recorded in it, so they load like a user's own. One
    compile cache for the session, never the user's: a method two packages
    share (`sample`, a model's forward under two recipes) compiles once, and
    a session compiles everything it tests at least once."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("trust")
        mp.setenv("KVEXPORT_TRUST_DIR", str(path))
        mp.setenv("KVEXPORT_COMPILE_CACHE", str(shared_folder(tmp_path_factory) / "compiled"))
        yield path


# an aoti package compiles every method (10-15 s each here): its tiny
# packages take one static size, the fewest that still covers every path
# (a decode of one real row padded to four, several rows, forward_others
# above them); test_kernels covers the kernels' row counts one by one
AOTI_FORWARD_SIZES = "4"


@pytest.fixture(scope="session")
def tiny_package(tmp_path_factory):
    """(model, backend="portable", **recipe) -> a package exported once per
    test session for that whole recipe (any spec keys: contract, qlinear,
    forward_sizes, ...), verified as the CLI does. Every test file asks this
    one factory, so two files that need the same package share it."""
    cache = {}
    shared = shared_folder(tmp_path_factory) / "packages"
    shared.mkdir(exist_ok=True)

    def get(model: str, backend: str = "portable", **recipe):
        if backend == "aoti":
            recipe.setdefault("forward_sizes", AOTI_FORWARD_SIZES)
        key = (model, backend, tuple(sorted(recipe.items())))
        if key not in cache:
            if backend == "aoti":  # native code: exported, trusted and used by the compile worker alone
                out = tmp_path_factory.mktemp(f"{model}-{backend}") / "pkg"
                cache[key] = export_tiny(model, out, backend=backend, **recipe).path
            else:
                name = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
                out = shared / f"{model}-{name}"
                with FileLock(str(shared / f"{name}.lock")):
                    if not (out / "manifest.json").is_file():  # an export is placed whole, or not at all
                        export_tiny(model, out, backend=backend, **recipe)
                cache[key] = out
        return cache[key]

    return get


@pytest.fixture(scope="session", params=["portable", pytest.param("aoti", marks=pytest.mark.compile)])
def backend(request):
    """Every test that runs tokens through a tiny runtime runs on both backends."""
    return request.param


@pytest.fixture(scope="session")
def tiny_runtime(tiny_package, backend):
    """model name -> a factory of fresh runtimes (empty cell caches) that
    share one loaded package, so programs are loaded once per session."""
    loaded = {}

    def get(model: str, **options) -> OffgraphKVManager:
        if model not in loaded:
            loaded[model] = load(tiny_package(model, backend)).package
        return OffgraphKVManager(loaded[model], **options)

    return get


@pytest.fixture(scope="session")
def hf_model():
    cache = {}

    def get(model: str):
        if model not in cache:
            cache[model] = load_model(model).model
        return cache[model]

    return get
