"""The README's table of verified architectures: exports each family's tiny
random model (exporter/sources/architectures.py) and checks it against Hugging Face.

    python bench/architectures.py            # markdown table
    python bench/architectures.py --json

Per family: every forward method's max |logits - HF forward| (fp32), and
whether 32 greedy tokens equal HF `generate` for three prompts (20, 5 and 30
tokens; 52 positions cross a window of 8 several times), alone and batched.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from kvexport.exporter.sources.architectures import ARCHITECTURES
from kvexport.exporter.sources.models import load_model
from kvexport.exporter.pipeline import export_package
from kvexport.exporter.spec import build_spec
from kvexport.runtime.verify import verify
from kvexport.runtime import load


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 1031, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def check(arch, workdir: Path) -> dict:
    builtin = f"tiny-{arch.key}"
    spec = build_spec(flags=dict(model=builtin, output=str(workdir / arch.key), use_offgraph_kv_cache=True,
                                 forward_sizes="1,2,4,8", max_step_tokens=24, max_cells=512))
    package = export_package(spec, progress=lambda m: None).path
    model = load_model(builtin).model
    report = verify(load(package), model, [prompt(20, 1), prompt(5, 2), prompt(30, 3)], 32)
    md = json.loads((package / "manifest.json").read_text())["metadata"]
    config = model.config
    return {
        "architecture": arch.name,
        "family": arch.family,
        "heads/kv_heads": f"{config.num_attention_heads}/{config.num_key_value_heads}",
        "head_dim": md["get_head_dims"][0],
        "windows": md["get_windows"],
        "tied": bool(config.tie_word_embeddings),
        "max_abs_logits_diff": max(report["max_abs_logits_diff"].values()),
        "greedy_32_equal": report["greedy_equal_alone"] and report["greedy_equal_batched"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [check(arch, Path(tmp)) for arch in ARCHITECTURES.values()]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| family | architectures | heads/kv | head_dim | windows | tied | max abs logits diff | greedy 32 = HF |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        windows = ", ".join(map(str, r["windows"]))
        print(f"| {r['family']} | `{r['architecture']}` | {r['heads/kv_heads']} | {r['head_dim']} | {windows} | "
              f"{'yes' if r['tied'] else 'no'} | {r['max_abs_logits_diff']:.1e} | {'yes' if r['greedy_32_equal'] else 'NO'} |")
    sys.exit(0 if all(r["greedy_32_equal"] and r["max_abs_logits_diff"] <= 1e-4 for r in rows) else 1)


if __name__ == "__main__":
    main()
