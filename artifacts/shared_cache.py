"""A cache of derived artifacts shared by runs: the trained tokenizer, the bootstrapped base and the sampler's export
depend only on the config (and, for the bootstrap, the seed and thread count), so a second run of a preset with a new
run directory copies them instead of spending minutes rebuilding them.

Where: $LGRPO_CACHE_DIR, else $XDG_CACHE_HOME/lgrpo, else ~/.cache/lgrpo; LGRPO_CACHE_DIR=off disables it. Entries
are directories of verified artifacts (sidecar digests), keyed by content hash under <root>/<kind>/<key>; an entry
is verified before use and one that does not verify is deleted with a warning and rebuilt, never used. The cache is
an accelerator only: failing to write it (read-only, disk full) warns and the run goes on."""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

from artifacts.progress import warn
from artifacts.store import ArtifactError, dir_digest

log = logging.getLogger("lgrpo.cache")


def cache_root() -> Path | None:
    env = os.environ.get("LGRPO_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0", "none") else Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "lgrpo"


def _warn(msg: str) -> None:
    warn(log, msg)


def _copy_dir(src: Path, dst: Path) -> None:
    """Copy a directory so that `dst` appears complete or not at all."""
    tmp = dst.with_name(f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}")
    shutil.copytree(src, tmp)
    try:
        os.rename(tmp, dst)
    except OSError:  # another run stored it first
        shutil.rmtree(tmp, ignore_errors=True)
        if not dst.exists():
            raise


def fetch(kind: str, key: str, target: Path) -> bool:
    """Copy the entry <kind>/<key> to `target` (absent) if the cache holds a valid one; True when it did."""
    root = cache_root()
    if root is None:
        return False
    entry = root / kind / key
    if not entry.is_dir():
        return False
    try:
        digest = dir_digest(entry)
    except ArtifactError as e:
        _warn(f"shared cache entry {entry} does not verify ({e}); deleting it and rebuilding")
        shutil.rmtree(entry, ignore_errors=True)
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    _copy_dir(entry, target)
    if dir_digest(target) != digest:  # the copy itself must verify to the same digest
        shutil.rmtree(target, ignore_errors=True)
        raise ArtifactError(target, f"copy of the shared cache entry {entry} differs from it")
    return True


def store(kind: str, key: str, source: Path) -> None:
    """Copy a freshly built artifact directory into the cache (no-op if the entry exists or the cache is off)."""
    root = cache_root()
    if root is None or (root / kind / key).is_dir():
        return
    try:
        (root / kind).mkdir(parents=True, exist_ok=True)
        _copy_dir(source, root / kind / key)
    except OSError as e:
        _warn(f"could not store {source} in the shared cache {root}: {e} (the run goes on without it)")
