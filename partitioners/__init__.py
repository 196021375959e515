"""Backends, one folder each (partitioners/<id>/), registered in
partitioners/registry.py when their folder is imported; this package
imports every folder it holds, so a new backend is a new folder."""

import importlib
import pkgutil


def _import_backend_folders() -> None:
    for module in pkgutil.iter_modules(__path__):
        if module.ispkg:
            importlib.import_module(f"{__name__}.{module.name}")


_import_backend_folders()
