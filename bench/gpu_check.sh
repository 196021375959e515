#!/usr/bin/env bash
# GPU check of the aoti backend, for a machine with an NVIDIA GPU and torch,
# transformers and safetensors installed (no network needed). Exports the
# tiny Llama and, when SMOLLM2_DIR points at a Hugging Face directory of
# SmolLM2-135M-Instruct (as `kvexport export smollm2-135m` caches it under
# ~/.cache/kvexport/gguf/), SmolLM2, each with --backend aoti --device cuda;
# checks greedy parity with HF on the GPU and prints decode tokens/s at
# batch 1 and 8. Budget: about 8 minutes.
#   PYTHONPATH=... bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
run() { python -m kvexport.cli.main "$@"; }
check() {  # model package
python - "$1" "$2" <<'PY'
import json, sys, time, torch
from kvexport.exporter.sources.models import load_model
from kvexport.runtime.verify import verify
from kvexport.runtime import generate, load
model, package = sys.argv[1], sys.argv[2]
hf = load_model(model).model.to("cuda")
rt = load(package)
vocab = rt.vocab_size
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, vocab, (24,), generator=g).tolist() for _ in range(8)]
report = verify(rt, hf, prompts[:2], 24)
result = {"model": model, "greedy_equal_hf": report["greedy_equal_alone"] and report["greedy_equal_batched"],
          "max_abs_logits_diff": max(report["max_abs_logits_diff"].values())}
for batch in (1, 8):
    generate(rt, prompts[:batch], 4, stop_at_eos=False)
    torch.cuda.synchronize(); start = time.perf_counter()
    generate(rt, prompts[:batch], 65, stop_at_eos=False)
    torch.cuda.synchronize(); long = time.perf_counter() - start
    start = time.perf_counter(); generate(rt, prompts[:batch], 1, stop_at_eos=False); short = time.perf_counter() - start
    result[f"decode_tokens_per_s_batch{batch}"] = round(batch * 64 / (long - short), 1)
print(json.dumps(result))
sys.exit(0 if result["greedy_equal_hf"] else 1)
PY
}
SMALL="--use-offgraph-kv-cache --backend aoti --device cuda --forward-sizes 1,2,4,8 --max-step-tokens 64 --max-cells 2048 --overwrite"
run export tiny-llama -o "$OUT/tiny" $SMALL
check tiny-llama "$OUT/tiny"
if [ -n "${SMOLLM2_DIR:-}" ]; then
  run export "$SMOLLM2_DIR" -o "$OUT/smollm2" $SMALL
  check "$SMOLLM2_DIR" "$OUT/smollm2"
else
  echo "SMOLLM2_DIR not set: SmolLM2 skipped"
fi
