"""What a package's tokenizer folder may hold, and what its config may say.

transformers opens whatever path a `tokenizer_config.json` names: a
`fast_tokenizer_files` entry that is absolute or climbs with `..` loads any
tokenizer on the machine (and whether it opened tells whether the path
exists), `init_inputs` feeds a tokenizer class positional paths, and
`auto_map` names code to import. So a package's tokenizer is:

- one flat folder of the files in TOKENIZER_FILES, nothing else (no
  subfolder: transformers reads every `chat_templates/*.jinja`);
- each file read once, never through a link, bounded in size, and checked
  against the manifest's digest from the bytes read;
- a config that names no path and no code: such a key with a value is
  refused, naming it; one that is null is dropped (transformers fails on
  some nulls, and a null names nothing).

`read_tokenizer_files` returns those bytes, the config rewritten without
its null keys; the runtime loads a private copy of exactly them
(runtime/text.py), and `validate` lists what `tokenizer_problems` finds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

from kvexport.contract.errors import PackageError

log = logging.getLogger(__name__)

CONFIG = "tokenizer_config.json"
# name -> most bytes: what transformers' save_pretrained writes for the
# tokenizers of the models kvexport exports (fast, sentencepiece, BPE)
TOKENIZER_FILES = {
    "tokenizer.json": 256 << 20,  # the largest real ones (Gemma 3's, 262 k tokens) are ~33 MB
    CONFIG: 8 << 20,  # Gemma 3's, listing every added token, is ~1.2 MB
    "special_tokens_map.json": 1 << 20,
    "added_tokens.json": 8 << 20,
    "tokenizer.model": 64 << 20,  # sentencepiece: ~4 MB for 256 k pieces
    "vocab.json": 64 << 20,
    "merges.txt": 64 << 20,
    "chat_template.jinja": 1 << 20,
    "chat_template.json": 1 << 20,
}
# parsed here: small JSON files transformers loads with json.load
# (tokenizer.json goes to the tokenizers library, which parses it natively)
PARSED = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.json")
# config keys whose value names a file or folder (vocab_file, tokenizer_file,
# special_tokens_map_file, fast_tokenizer_files, name_or_path, cache_dir, ...)
PATH_KEY = re.compile(r".*(?:file|files|dir|path)", re.IGNORECASE)
MAX_ENTRIES = 64
CODE_KEYS = ("auto_map",)  # "module.Class" references imported with trust_remote_code
POSITIONAL_KEYS = ("init_inputs",)  # a slow tokenizer's first positional argument is its vocab file's path


def _folder(reader) -> str | None:
    """The tokenizer folder's path inside the package, or None when the
    package carries none; raises PackageError unless it is a folder inside."""
    path = reader.tokenizer_dir
    return None if path is None else path.relative_to(reader.path).as_posix()


def read_tokenizer_files(reader) -> dict[str, bytes]:
    """name -> bytes of every tokenizer file, checked as the module says;
    raises PackageError naming the first problem."""
    files, problems = _read(reader, digests=True)
    if problems:
        raise PackageError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return files


def tokenizer_problems(reader) -> list[str]:
    """Every problem of the package's tokenizer folder, for validate (whose
    checksum check compares the digests)."""
    try:
        return _read(reader, digests=False)[1]
    except PackageError as e:
        return [str(e)]


def _read(reader, digests: bool) -> tuple[dict[str, bytes], list[str]]:
    folder = _folder(reader)
    if folder is None:
        return {}, []
    problems, files = [], {}
    for name, is_dir in _entries(reader.path / folder):
        where = f"{reader.path}: {repr(f'{folder}/{name}')[:200]}"
        if is_dir:
            problems.append(f"{where}: a folder; a package's tokenizer folder holds files only ({', '.join(TOKENIZER_FILES)})")
        elif name not in TOKENIZER_FILES:
            problems.append(f"{where}: not a tokenizer file kvexport loads ({', '.join(TOKENIZER_FILES)}); remove it")
        else:
            try:
                files[name] = _checked(reader, f"{folder}/{name}", name, digests)
            except PackageError as e:
                problems.append(str(e))
    if not files and not problems:
        problems.append(f"{reader.path}: tokenizer {folder}: holds none of {', '.join(TOKENIZER_FILES)}")
    return files, problems


def _entries(path: Path) -> list[tuple[str, bool]]:
    """The folder's entries, a link counted as a file (reading it refuses it)."""
    entries = []
    try:
        with os.scandir(path) as it:
            for entry in it:
                if len(entries) > MAX_ENTRIES:  # a planted million files: refused without listing them
                    raise PackageError(f"{path}: more than {MAX_ENTRIES} entries; a tokenizer folder holds {len(TOKENIZER_FILES)} files at most")
                entries.append((entry.name, entry.is_dir(follow_symlinks=False)))
    except OSError as e:
        raise PackageError(f"{path}: cannot list the tokenizer folder ({e.strerror or e})") from None
    return sorted(entries)


def _checked(reader, rel: str, name: str, digest: bool) -> bytes:
    """One file's bytes: read once, bounded, matched to the manifest's
    digest from those bytes, its JSON parsed and the config's keys checked."""
    data = reader.read_file(rel, f"tokenizer file {name}", TOKENIZER_FILES[name])
    if digest:
        reader.require_digest(rel, len(data), hashlib.sha256(data).hexdigest())
    if name in PARSED:
        where = f"{reader.path}: {rel}"
        value = _json(data, where)
        if name == CONFIG:
            data = sanitized_config(value, where)
    return data


def _json(data: bytes, rel: str) -> object:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise PackageError(f"{rel}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None


def sanitized_config(config: object, rel: str = CONFIG) -> bytes:
    """The config without its null path keys; refuses one that names a
    path, code or positional arguments."""
    if not isinstance(config, dict):
        raise PackageError(f"{rel}: not a JSON object (found a {type(config).__name__})")
    refused = sorted(k for k, v in config.items() if v is not None and _names_something(k))
    if refused:
        raise PackageError(
            f"{rel}: {', '.join(repr(k)[:80] for k in refused)}: a package's tokenizer config may name no file, folder "
            f"or code (transformers would open or import it, inside the package or not); remove "
            f"{'it' if len(refused) == 1 else 'them'} and fix the checksum"
        )
    kept = {k: v for k, v in config.items() if not (v is None and _names_something(k))}
    if len(kept) < len(config):
        log.info("%s: dropped the null keys %s", rel, sorted(set(config) - set(kept)))
    return json.dumps(kept, ensure_ascii=False, indent=1, sort_keys=True).encode()


def _names_something(key: str) -> bool:
    return key in CODE_KEYS or key in POSITIONAL_KEYS or bool(PATH_KEY.fullmatch(key))
