"""Helpers shared by the tests (importable: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import pytest
import torch

from kvexport.cli.main import _check_package
from kvexport.exporter.pipeline import export_package
from kvexport.exporter.spec import build_spec
from kvexport.runtime.verify import hf_greedy  # noqa: F401  (re-exported for the tests)

TINY = ("tiny-llama", "tiny-qwen2")
# the runtime tests run both tiny models on the portable backend and one on
# the aoti backend (tiny-qwen2: biased projections; a compiled package costs
# half a minute): `@pytest.mark.parametrize("model, backend", MODEL_BACKENDS,
# indirect=["backend"])`
AOTI_MODEL = "tiny-qwen2"
MODEL_BACKENDS = [(model, "portable") for model in TINY] + [pytest.param(AOTI_MODEL, "aoti", marks=pytest.mark.compile)]
# small enough to export fast (each method is a trace), wide enough that a
# prompt crosses every kind of method: one row, several, forward_others
TINY_LAYOUT = dict(forward_sizes="1,4", max_step_tokens=24, max_cells=512)


TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
# models whose export fails under torch 2.11 (the fast tier is checked there by hand), and why
UNTRACEABLE_BEFORE_2_13 = {
    "tiny-gemma2": "it traces under torch 2.11, but transformers 5.17's Gemma2 logits differ from the package's by 0.017",
}

PROGRESS: dict[str, list[str]] = {}  # the progress lines of each export_tiny in this process, by output path


def export_tiny(model: str, out, *, check_package=_check_package, transform_passes=(), partitioners=None, dump_graphs=None,
                **overrides):
    """Exports as the CLI does: the package must reproduce its reference
    tokens (unless verify=False) before it is written."""
    if model in UNTRACEABLE_BEFORE_2_13 and TORCH < (2, 13):
        pytest.skip(f"{model}: {UNTRACEABLE_BEFORE_2_13[model]} (docs/torch-versions.md)")
    flags = dict(model=model, output=str(out), use_offgraph_kv_cache=True, **TINY_LAYOUT)
    if overrides.get("backend") == "aoti":
        flags["row_kernel"] = "on"  # every token test of an aoti package runs the row kernel, on any machine
    flags.update(overrides)
    lines = PROGRESS.setdefault(str(out), [])
    return export_package(build_spec(flags=flags), progress=lines.append, check_package=check_package,
                          transform_passes=transform_passes, partitioners=partitioners, dump_graphs=dump_graphs)


def prompt_of(length: int, seed: int, vocab: int = 1031) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def drafts_cost_nothing(monkeypatch) -> None:
    """Speculative decoding drafts as much as each step's width allows: no
    call is timed, so every width costs the same, and a draft package's
    steps cost nothing (runtime/speculative.py, plan_drafts)."""
    import kvexport.runtime.speculative as speculative
    from kvexport.runtime.offgraph import MethodCosts

    monkeypatch.setattr(MethodCosts, "observe", lambda self, method, seconds: None)
    monkeypatch.setattr(speculative, "_measured", lambda manager: True)
    monkeypatch.setattr(speculative, "_draft_seconds", lambda draft, cost, allowed: 0.0)
