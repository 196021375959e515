"""`--state-dir`: the prefix cache's sessions outlive the server.

At shutdown every session the prefix cache keeps is written to a subfolder
named for the package's manifest digest, one safetensors file each: its token
ids and its K/V in the package's cell layout (one [length, heads, head_dim]
tensor per pool, in position order), tagged with the digest. At start that
subfolder's files are read back into the pool as cached sessions, so a
conversation continues where it was after a restart. Another package's
sessions are never read (the log counts them), and a file whose tag is not
this package's, or that does not fit this pool, is not restored: the log
says why.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from kvexport.contract.errors import KvexportError
from kvexport.runtime.server.prefix_cache import PrefixCache

log = logging.getLogger(__name__)

FORMAT = "kvexport-session-v1"
PREFIX = "session-"
DIGEST_CHARS = 16


def save_sessions(prefix: PrefixCache, folder: Path, package_digest: str) -> int:
    """Writes every cached session to folder (replacing what an earlier run
    saved there); returns how many."""
    from safetensors.torch import save_file

    folder = folder / package_digest[:DIGEST_CHARS]
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob(f"{PREFIX}*.safetensors"):
        old.unlink()
    cache = prefix.manager.cache
    saved = 0
    for holder in [h for h in prefix.holders.values() if h.cached]:
        pools = cache.read_sequence(holder.session.seq)
        tensors = {"tokens": torch.tensor(holder.tokens[: holder.session.length], dtype=torch.int64)}
        tensors |= {f"pool.{i}": pool.contiguous() for i, pool in enumerate(pools)}
        target = folder / f"{PREFIX}{saved:03d}.safetensors"
        partial = target.with_suffix(".partial")
        save_file(tensors, str(partial), metadata={"format": FORMAT, "package": package_digest})
        os.replace(partial, target)
        saved += 1
    return saved


def restore_sessions(prefix: PrefixCache, folder: Path, package_digest: str) -> int:
    """Reads the sessions saved for this package back as cached sessions;
    returns how many."""
    from safetensors import safe_open

    manager = prefix.manager
    restored = 0
    others = [p.name for p in folder.iterdir() if p.is_dir() and p.name != package_digest[:DIGEST_CHARS]]
    if others:
        log.info("%s holds the sessions of %d other packages: not restored for this one", folder, len(others))
    folder = folder / package_digest[:DIGEST_CHARS]
    for path in sorted(folder.glob(f"{PREFIX}*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != FORMAT:
                    raise KvexportError(f"not a {FORMAT} file")
                if meta.get("package") != package_digest:
                    raise KvexportError(f"saved for package {meta.get('package', '?')[:16]}..., not this one "
                                        f"({package_digest[:16]}...)")
                tokens = f.get_tensor("tokens")
                pools = [f.get_tensor(f"pool.{i}") for i in range(len([k for k in f.keys() if k.startswith("pool.")]))]
        except (OSError, ValueError, KvexportError) as e:
            log.warning("%s: not restored: %s", path, e)
            continue
        if tokens.dtype != torch.int64 or tokens.dim() != 1 or not pools or pools[0].shape[0] != tokens.shape[0]:
            log.warning("%s: not restored: its tokens do not match its cells", path)
            continue
        session = manager.new_session()
        try:
            manager.cache.write_sequence(session.seq, pools)
        except KvexportError as e:
            manager.release(session)
            log.warning("%s: not restored: %s", path, e)
            continue
        prefix.retire(prefix.hold(session, tokens.tolist()))
        restored += 1
    return restored
