"""Shared fixtures: tiny packages are exported once per test session."""

from __future__ import annotations

import pytest

from helpers import export_tiny
from kvexport.exporter.models import load_model
from kvexport.runtime import OffgraphKVManager, load


@pytest.fixture(scope="session")
def tiny_package(tmp_path_factory):
    """model name -> exported package path (fp32)."""
    cache = {}

    def get(model: str):
        if model not in cache:
            cache[model] = export_tiny(model, tmp_path_factory.mktemp(model) / "pkg").path
        return cache[model]

    return get


@pytest.fixture(scope="session")
def tiny_runtime(tiny_package):
    """model name -> a factory of fresh runtimes (empty cell caches) that
    share one loaded package, so programs are rebuilt once per session."""
    loaded = {}

    def get(model: str, **options) -> OffgraphKVManager:
        if model not in loaded:
            loaded[model] = load(tiny_package(model)).package
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
