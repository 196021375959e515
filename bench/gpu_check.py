"""The GPU check: export, parity with HF and speed of aoti packages on one device.

    python bench/gpu_check.py --out RESULT.json [--device cuda|cpu] [--shapes a,b] [--deadline 420]

Run through bench/gpu_check.sh, which installs what the GPU image lacks from
the wheels `gpu_check.sh prepare` brought along. For each model, in order:
1. writes it (the shapes: random weights as bench/big_model.py writes them,
   bf16; tiny-llama: the built-in test model, fp32) and exports it with
   `--backend aoti --device DEVICE --forward-sizes 1,8,64 --max-step-tokens 512`;
2. greedy parity with HF on the device: 4 prompts x 16 tokens, alone and
   batched, with and without CUDA graphs (fp32: the tokens must be equal;
   bf16 over random weights has near-ties, so it reports how many prompts
   agree and the last row's logits cosine, which must be > 0.99);
3. decode tokens/s at 1, 8 and 64 sessions with and without CUDA graphs, and
   a 512-token prefill beside HF's forward over the same prompt.
The JSON is rewritten after every model, so a run cut short keeps what it
measured. A model that would not finish before --deadline is skipped, and
said so. Exit code 1 if any parity check failed.

--device cpu is the dry run: the same steps on the CPU, where "CUDA graphs"
are runtime/step_graphs.py's fixed buffers without a graph, over shapes a
2-core machine exports in minutes (tiny-llama and big_model's llama-small).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

DEFAULT_SHAPES = {"cuda": "tiny-llama,llama3.2-1b,llama3.1-8b", "cpu": "tiny-llama,llama-small"}
LAYOUT = ["--forward-sizes", "1,8,64", "--max-step-tokens", "512", "--max-cells", "8192", "--max-context-len", "1024"]
SESSIONS = (1, 8, 64)
PARITY_PROMPTS, PARITY_TOKENS = 4, 16
DECODE_TOKENS = 32


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def source(name: str, work: Path) -> tuple[str, str]:
    """(what `kvexport export` takes, dtype) for a model of the check."""
    if name.startswith("tiny-"):
        return name, "fp32"
    from big_model import write_checkpoint  # beside this script

    directory = work / f"model-{name}"
    start = time.perf_counter()
    write_checkpoint(name, "bf16", directory)
    log(f"{name}: random bf16 weights written in {time.perf_counter() - start:.0f} s")
    return str(directory), "bf16"


def hf_model(model: str, dtype: str, device: str):
    if model.startswith("tiny-"):
        from kvexport.exporter.sources.models import load_model

        return load_model(model).model.to(device).eval()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(device).eval()


def export(model: str, dtype: str, device: str, package: Path) -> float:
    start = time.perf_counter()
    command = [sys.executable, "-m", "kvexport.cli.main", "export", model, "-o", str(package), "--use-offgraph-kv-cache",
               "--backend", "aoti", "--device", device, "--dtype", dtype, *LAYOUT, "--overwrite"]
    if dtype != "fp32":
        command.append("--no-verify")  # the check below compares with HF itself
    log(" ".join(command[2:]))
    subprocess.run(command, check=True)
    return round(time.perf_counter() - start, 1)


def parity(runtimes: dict, hf, vocab: int, exact: bool, device: str) -> dict:
    from kvexport.runtime import StepEntry, generate
    from kvexport.runtime.verify import hf_greedy

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (24,), generator=generator).tolist() for _ in range(PARITY_PROMPTS)]
    want = [hf_greedy(hf, p, PARITY_TOKENS) for p in prompts]
    result: dict = {"prompts": PARITY_PROMPTS, "tokens": PARITY_TOKENS}
    for label, rt in runtimes.items():
        alone = [generate(rt, [p], PARITY_TOKENS, stop_at_eos=False)[0] for p in prompts]
        batched = generate(rt, prompts, PARITY_TOKENS, stop_at_eos=False)
        result[f"{label}_alone_equal_hf"] = sum(a == w for a, w in zip(alone, want))
        result[f"{label}_batched_equal_hf"] = sum(b == w for b, w in zip(batched, want))
    rt = runtimes["graphs"]
    cosines = []
    for p in prompts:
        session = rt.new_session()
        [ours] = rt.step([StepEntry(session, p)])
        rt.release(session)
        with torch.no_grad():
            ref = hf(torch.tensor([p], device=device)).logits[0, -1].float()
        cosines.append(float(torch.nn.functional.cosine_similarity(ref, ours.float().to(ref.device), dim=0)))
    result["last_row_logits_cosine_min"] = round(min(cosines), 6)
    counts = [v for k, v in result.items() if k.endswith("_equal_hf")]
    result["ok"] = all(c == PARITY_PROMPTS for c in counts) if exact else min(cosines) > 0.99
    return result


def decode_rate(rt, sessions: int, vocab: int, device: str) -> float:
    """Tokens/s of `sessions` sessions decoding together: (time for a prompt
    and N tokens) - (time for the prompt and 1 token)."""
    from kvexport.runtime import generate

    generator = torch.Generator().manual_seed(sessions)
    prompts = [torch.randint(3, vocab, (16,), generator=generator).tolist() for _ in range(sessions)]
    generate(rt, prompts, 4, stop_at_eos=False)  # warm-up: first calls, graph captures
    times = []
    for n in (DECODE_TOKENS + 1, 1):
        sync(device)
        start = time.perf_counter()
        generate(rt, prompts, n, stop_at_eos=False)
        sync(device)
        times.append(time.perf_counter() - start)
    return round(sessions * DECODE_TOKENS / max(times[0] - times[1], 1e-9), 1)


def prefill(rt, hf, vocab: int, device: str) -> dict:
    from kvexport.runtime import generate

    prompt = torch.randint(3, vocab, (512,), generator=torch.Generator().manual_seed(5)).tolist()
    best = {"package": float("inf"), "hf": float("inf")}
    ids = torch.tensor([prompt], device=device)
    for _ in range(3):
        for who in best:
            sync(device)
            start = time.perf_counter()
            if who == "package":
                generate(rt, [prompt], 1, stop_at_eos=False)
            else:
                with torch.no_grad():
                    hf(ids, logits_to_keep=1)
            sync(device)
            best[who] = min(best[who], time.perf_counter() - start)
    return {"package_tokens_per_s": round(512 / best["package"], 1), "hf_tokens_per_s": round(512 / best["hf"], 1)}


def check_model(name: str, device: str, work: Path) -> dict:
    from kvexport.runtime import load
    from kvexport.runtime.offgraph import OffgraphKVManager

    model, dtype = source(name, work)
    package = work / f"pkg-{name}"
    result: dict = {"dtype": dtype, "export_s": export(model, dtype, device, package)}
    plain = load(str(package), trust_native_code=True, cuda_graphs=False)
    graphs = OffgraphKVManager(plain.package, cuda_graphs=True)
    runtimes = {"plain": plain, "graphs": graphs}
    vocab = plain.vocab_size
    hf = hf_model(model, dtype, device)
    log(f"{name}: parity")
    result["parity"] = parity(runtimes, hf, vocab, exact=dtype == "fp32", device=device)
    log(f"{name}: decode")
    for label, rt in runtimes.items():
        for sessions in SESSIONS:
            result[f"decode_tokens_per_s_{sessions}_{label}"] = decode_rate(rt, sessions, vocab, device)
            log(f"{name}: {sessions} sessions, {label}: {result[f'decode_tokens_per_s_{sessions}_{label}']} tokens/s")
    result["prefill_512"] = prefill(plain, hf, vocab, device)
    del hf, plain, graphs, runtimes
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def machine(device: str) -> dict:
    import transformers

    import kvexport.runtime

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "cpu_threads": torch.get_num_threads(), "kvexport_from": str(Path(kvexport.runtime.__file__).parent.parent)}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        pass
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--shapes", help=f"comma-separated models (default on cuda: {DEFAULT_SHAPES['cuda']}; "
                        f"on cpu: {DEFAULT_SHAPES['cpu']})")
    parser.add_argument("--deadline", type=float, default=420, help="seconds: no model starts after this much is spent")
    parser.add_argument("--work", type=Path, help="where models and packages go (default: a temporary folder)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: --device cuda, but torch sees no CUDA device (run with --device cpu for the dry run)")
    start = time.perf_counter()
    result: dict = {"device": args.device, "machine": machine(args.device), "models": {}}
    if os.environ.get("KVEXPORT_WHEELS_MB"):
        result["wheels_brought_mb"] = float(os.environ["KVEXPORT_WHEELS_MB"])
    work = args.work or Path(tempfile.mkdtemp(prefix="kvexport-gpu-check-"))
    for name in (args.shapes or DEFAULT_SHAPES[args.device]).split(","):
        spent = time.perf_counter() - start
        if spent > args.deadline:
            result["models"][name] = {"skipped": f"the deadline ({args.deadline:.0f} s) had passed ({spent:.0f} s spent)"}
        else:
            log(f"{name}: start ({spent:.0f} s spent)")
            try:
                result["models"][name] = check_model(name, args.device, work)
            except Exception as e:  # noqa: BLE001 (the next model still runs; the JSON says what broke)
                result["models"][name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
                log(f"{name}: {type(e).__name__}: {e}")
        result["elapsed_s"] = round(time.perf_counter() - start, 1)
        args.out.write_text(json.dumps(result, indent=1, sort_keys=True))
    print(json.dumps(result, indent=1, sort_keys=True))
    failed = [n for n, r in result["models"].items() if "error" in r or not r.get("parity", {"ok": True})["ok"]]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
