"""Shared fixtures: tiny packages are exported once per test session."""

from __future__ import annotations

import pytest

from helpers import export_tiny
from kvexport.exporter.sources.models import load_model
from kvexport.runtime import OffgraphKVManager, load


@pytest.fixture(scope="session", autouse=True)
def session_trust_dir(tmp_path_factory):
    """One trust store for the session, never the user's: the aoti packages
    exported here are recorded in it, so they load like a user's own."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("trust")
        mp.setenv("KVEXPORT_TRUST_DIR", str(path))
        yield path


# an aoti package compiles every method (10-15 s each here): its tiny
# packages take the fewest static sizes that still cover every path (one
# row, several rows, forward_others above them)
AOTI_FORWARD_SIZES = "1,4"


@pytest.fixture(scope="session")
def tiny_package(tmp_path_factory):
    """(model, backend="portable", **recipe) -> a package exported once per
    test session for that whole recipe (any spec keys: contract, qlinear,
    forward_sizes, ...), verified as the CLI does. Every test file asks this
    one factory, so two files that need the same package share it."""
    cache = {}

    def get(model: str, backend: str = "portable", **recipe):
        if backend == "aoti":
            recipe.setdefault("forward_sizes", AOTI_FORWARD_SIZES)
        key = (model, backend, tuple(sorted(recipe.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{model}-{backend}") / "pkg"
            cache[key] = export_tiny(model, out, backend=backend, **recipe).path
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
