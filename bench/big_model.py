"""A real-size model through export, in bounded memory.

    python bench/big_model.py --shape llama3.2-1b --dtype fp32 [--backend portable] [--dir D]
    python bench/big_model.py --shape qwen2.5-7b --dtype bf16 --no-verify

1. Writes a model of the shape's architecture with random weights to a local
   Hugging Face directory (sharded safetensors with an index, like a real
   checkpoint), one tensor in memory at a time; kept in --dir for reruns.
2. Times a copy of the source's bytes into a file beside the package (read
   and write: the floor an export's wall time is compared with).
3. Runs `kvexport export` on it in a child process and samples the whole
   process tree (compile workers included) every 0.2 s: peak RSS and peak
   anonymous RSS (private memory; the rest of RSS is file pages, which the
   kernel can drop and read again, so they do not bound the model's size).
   With --memory-limit 6G the export runs in a memory cgroup of that size,
   page cache included: a model larger than the limit must still export.
4. Loads the package in two runtime processes at once: load seconds and
   each one's PSS/USS after touching every weight.
5. Runs HF (`from_pretrained`) and the package on a few random prompts:
   the last row's logits cosine and top-1 agreement.

Prints JSON. Every ratio comes from this one run; say which CPU (lscpu).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from common import cpu_model, emit
from kvexport.exporter.memory import private_memory_mb

# what Qwen2.5's released configs share (untied head, biased q/k/v)
QWEN25 = dict(
    model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=152064, max_position_embeddings=32768,
    rope_theta=1000000.0, tie_word_embeddings=False, sliding_window=131072, use_sliding_window=False,
    bos_token_id=151643, eos_token_id=151645,
)
SHAPES = {
    # Llama 3.2 1B's config (tied embeddings, rope scaling as released)
    "llama3.2-1b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        bos_token_id=128000, eos_token_id=128001,
    ),
    # Llama 3.1 8B's config (untied head): 16 GB in bf16
    "llama3.1-8b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        bos_token_id=128000, eos_token_id=128001,
    ),
    "qwen2.5-7b": dict(
        QWEN25, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, rms_norm_eps=1e-6, max_window_layers=28,
    ),
    # 29.5 GB in bf16: more than a 24 GB machine's memory
    "qwen2.5-14b": dict(
        QWEN25, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
        num_key_value_heads=8, rms_norm_eps=1e-5, max_window_layers=48,
    ),
    # a small stand-in with the same code path, for trying the script itself
    "llama-small": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=512, intermediate_size=1536,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHARD_BYTES = 2 << 30


def write_checkpoint(shape: str, dtype: str, directory: Path, overrides: dict | None = None) -> dict:
    """The shape's model as sharded safetensors with random weights (std
    0.02, norms 1), one tensor generated at a time, its config changed by
    `overrides` (another vocabulary). Reused when complete."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvexport.contract.safetensors_io import SafetensorsWriter

    done = directory / "model.safetensors.index.json"
    written = [shape, dtype, overrides] if overrides else [shape, dtype]
    if done.is_file() and json.loads(done.read_text()).get("kvexport_bench") == written:
        return {"written_s": 0.0, "reused": True}
    start = time.perf_counter()
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    spec = dict(SHAPES[shape]) | (overrides or {})
    config = AutoConfig.for_model(spec.pop("model_type"), **spec, torch_dtype=dtype.replace("fp32", "float32").replace("bf16", "bfloat16"))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = {k: (DTYPES[dtype], tuple(v.shape)) for k, v in skeleton.state_dict().items()}
    if config.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    shards, current, size = [], {}, 0
    for name in sorted(names):
        nbytes = torch.Size(names[name][1]).numel() * names[name][0].itemsize
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = names[name]
        size += nbytes
    shards.append(current)
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        with SafetensorsWriter(directory / file, shard, {"format": "pt"}) as writer:
            for name in writer.names:
                dtype_, shape_ = shard[name]
                if name.endswith("norm.weight"):
                    value = torch.ones(shape_, dtype=dtype_)
                else:
                    value = (torch.randn(shape_, generator=generator) * 0.02).to(dtype_)
                writer.write(name, value)
                weight_map[name] = file
        print(f"wrote {file}", file=sys.stderr, flush=True)
    config.save_pretrained(directory)
    total = sum(torch.Size(s).numel() * d.itemsize for d, s in names.values())
    done.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map, "kvexport_bench": written}))
    return {"written_s": round(time.perf_counter() - start, 1), "reused": False}


def copy_seconds(source: Path, target: Path) -> float:
    """Reading every source shard and writing it again: the I/O an export
    cannot avoid."""
    start = time.perf_counter()
    with open(target, "wb") as out:
        for shard in sorted(source.glob("*.safetensors")):
            with open(shard, "rb") as f:
                shutil.copyfileobj(f, out, 64 << 20)
        out.flush()
        os.fsync(out.fileno())
    seconds = time.perf_counter() - start
    target.unlink()
    return seconds


def memory_cgroup(limit: str) -> Path:
    """A cgroup-v1 memory cgroup whose limit (page cache included: the
    kernel drops clean file pages to stay under it) is `limit` (e.g. 6G);
    needs root and a writable /sys/fs/cgroup/memory."""
    root = Path("/sys/fs/cgroup/memory")
    if not (root / "memory.limit_in_bytes").exists():
        sys.exit("--memory-limit needs a cgroup-v1 memory controller at /sys/fs/cgroup/memory")
    group = root / f"kvexport-bench-{os.getpid()}"
    group.mkdir(exist_ok=True)
    (group / "memory.limit_in_bytes").write_text(limit)
    # pages already cached are charged to whoever read them first: drop them,
    # so that every page the export reads counts against its limit
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1")
    except OSError:
        print("could not drop the page cache: pages cached before the export are not charged to its cgroup", file=sys.stderr)
    return group


def run_sampled(command: list[str], cgroup: Path | None = None) -> dict:
    """Runs `command` (in `cgroup`, when given), sampling its process tree's
    memory; its output goes to stderr."""
    peaks = {"rss": 0.0, "anon": 0.0}
    join = (lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid()))) if cgroup else None
    proc = subprocess.Popen(command, stdout=sys.stderr, preexec_fn=join)
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            rss, anon = private_memory_mb(proc.pid)
            peaks["rss"], peaks["anon"] = max(peaks["rss"], rss), max(peaks["anon"], anon)
            stop.wait(0.2)

    thread = threading.Thread(target=sample, daemon=True)
    start = time.perf_counter()
    thread.start()
    code = proc.wait()
    wall = time.perf_counter() - start
    stop.set()
    thread.join()
    if code != 0:
        sys.exit(f"export failed with exit code {code}")
    out = {"wall_s": round(wall, 1), "peak_rss_tree_mb": round(peaks["rss"]), "peak_anon_rss_tree_mb": round(peaks["anon"])}
    if cgroup:
        out["cgroup_limit_mb"] = int((cgroup / "memory.limit_in_bytes").read_text()) >> 20
        out["cgroup_peak_mb"] = int((cgroup / "memory.max_usage_in_bytes").read_text()) >> 20
        out["cgroup_oom_kills"] = int(re.search(r"oom_kill (\d+)", (cgroup / "memory.oom_control").read_text()).group(1))
    return out


HOLDER = r"""
import json, sys, time
from kvexport.runtime import load
start = time.perf_counter()
rt = load(sys.argv[1], trust_native_code=True)
loaded = time.perf_counter()
for t in rt.package.tensors.values():  # touch every page
    t.view(-1)[:: max(1, 4096 // t.element_size())].sum() if t.numel() else None
print(json.dumps({"load_s": round(loaded - start, 2)}), flush=True)
sys.stdin.read()
"""


def two_runtimes(package: Path) -> list:
    """Two runtimes of one package at once, each having touched every
    weight: load seconds, and each one's memory read once both hold it."""
    children = [subprocess.Popen([sys.executable, "-c", HOLDER, str(package)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        out = [json.loads(child.stdout.readline()) for child in children]
        for entry, child in zip(out, children):
            fields = dict(re.findall(r"^(\w+):\s+(\d+) kB", open(f"/proc/{child.pid}/smaps_rollup").read(), re.M))
            entry.update(pss_mb=int(fields["Pss"]) // 1024, rss_mb=int(fields["Rss"]) // 1024,
                         uss_mb=(int(fields["Private_Clean"]) + int(fields["Private_Dirty"])) // 1024,
                         private_anon_mb=int(fields["Anonymous"]) // 1024)
        return out
    finally:
        for child in children:
            child.stdin.close()
            child.wait()


def parity(directory: Path, package: Path, dtype: str, prompts: int, length: int) -> dict:
    """Last-row logits of HF and of the package on random prompts."""
    from transformers import AutoModelForCausalLM

    from kvexport.runtime import StepEntry, load

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=DTYPES[dtype]).eval()
    rt = load(str(package), trust_native_code=True)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    cosines, agree = [], 0
    for _ in range(prompts):
        ids = torch.randint(0, vocab, (length,), generator=generator)
        with torch.no_grad():
            ref = model(ids[None]).logits[0, -1].float()
        session = rt.new_session()
        [ours] = rt.step([StepEntry(session, ids.tolist())])
        rt.release(session)
        cosines.append(float(torch.nn.functional.cosine_similarity(ref, ours.float(), dim=0)))
        agree += int(ref.argmax() == ours.argmax())
    return {"prompts": prompts, "prompt_len": length, "logits_cosine_min": round(min(cosines), 6), "top1_agreement": agree / prompts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3.2-1b")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--backend", default="portable")
    parser.add_argument("--dir", type=Path, help="Where the checkpoint is written (kept); default: a folder in the temp dir.")
    parser.add_argument("--forward-sizes", default="1,4")
    parser.add_argument("--no-verify", action="store_true", help="Export without the reference check.")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--export-args", default="", help="More options for kvexport export, as one string.")
    parser.add_argument("--memory-limit", help="Run the export in a memory cgroup with this limit, page cache "
                        "included (e.g. 6G; root, cgroup v1): a model larger than the limit must still export.")
    parser.add_argument("--skip-runtimes", action="store_true", help="Skip the two-runtime and parity measurements.")
    args = parser.parse_args()

    directory = args.dir or Path(tempfile.gettempdir()) / f"kvexport-big-{args.shape}-{args.dtype}"
    result = {"cpu": cpu_model(), "shape": args.shape, "dtype": args.dtype, "backend": args.backend}
    result["checkpoint"] = write_checkpoint(args.shape, args.dtype, directory)
    weights = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    result["weights_mb"] = round(weights / 2**20)
    with tempfile.TemporaryDirectory(dir=directory.parent, prefix="kvexport-big-pkg-") as tmp:
        package = Path(tmp) / "pkg"
        result["copy_source_s"] = round(copy_seconds(directory, Path(tmp) / "copy"), 1)
        report = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "kvexport.cli.main", "export", str(directory), "-o", str(package),
                   "--dtype", args.dtype, "--backend", args.backend, "--use-offgraph-kv-cache",
                   "--forward-sizes", args.forward_sizes, "--max-step-tokens", "64", "--max-cells", "1024",
                   "--max-context-len", "1024", "--report", str(report), *args.export_args.split()]
        if args.no_verify:
            command.append("--no-verify")
        result["export"] = run_sampled(command, memory_cgroup(args.memory_limit) if args.memory_limit else None)
        steps = json.loads(report.read_text())["steps"]
        result["export"]["steps_s"] = {row["step"]: row["seconds"] for row in steps}
        package_bytes = sum(p.stat().st_size for p in package.rglob("*") if p.is_file())
        result["package_over_weights"] = round(package_bytes / weights, 4)
        budget = 1.5 * 1024 + 0.25 * weights / 2**20
        result["goal_peak_mb"] = round(budget)
        result["anon_peak_over_goal"] = round(result["export"]["peak_anon_rss_tree_mb"] / budget, 3)
        result["rss_peak_over_goal"] = round(result["export"]["peak_rss_tree_mb"] / budget, 3)
        result["wall_over_copy"] = round(result["export"]["wall_s"] / result["copy_source_s"], 2)
        if not args.skip_runtimes:
            result["two_runtimes"] = two_runtimes(package)
            result["parity"] = parity(directory, package, args.dtype, args.prompts, 16)
    emit(result)


if __name__ == "__main__":
    main()
