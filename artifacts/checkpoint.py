"""A local checkpoint used in place: hashed once, referenced by the run, re-verified on every load.

A `model.source: pretrained` run does not copy the checkpoint (54 GB for the 27B model). The bootstrap stage
writes a small sealed reference directory into the run (`checkpoint_ref.json`: the checkpoint's absolute path, its
digest and every file's size, mtime and sha256); engines load the checkpoint from where it is through `resolve`,
which checks each file against the reference first:

* size and mtime unchanged: the file is taken as recorded (a stat per file, no reading);
* size or mtime changed: the file is hashed again; the same bytes pass (a `touch`), other bytes are refused with
  `CheckpointChanged` naming the file -- a run never trains on a checkpoint other than the one it recorded.

Hashing a 54 GB checkpoint takes minutes, so the per-file hashes are cached, keyed by absolute path, size and
mtime: in the shared cache (artifacts/shared_cache.py: `<cache>/checkpoint-hashes/`, shared by every run of this
user) and in the run's own reference. A second run on the same checkpoint hashes nothing.

Which files count: every regular file under the directory (symlinks followed: Hugging Face cache snapshots are
links to blobs) except hidden ones (`.cache/`, `.gitattributes`: download tools rewrite them) and `*.sha256`.
No torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from artifacts.store import ArtifactError, atomic_write, read_json, sha256_file, verify

REF_NAME = "checkpoint_ref.json"
REF_VERSION = 1


class CheckpointChanged(ArtifactError):
    """The checkpoint a run recorded is not on disk as it was (edited, replaced, moved or partly deleted)."""


def checkpoint_files(src: Path) -> list[str]:
    """Relative names of the files that make up the checkpoint directory `src`, sorted."""
    out = []
    for f in src.rglob("*"):
        rel = f.relative_to(src)
        if any(part.startswith(".") for part in rel.parts) or f.name.endswith(".sha256"):
            continue
        if f.is_file():
            out.append(rel.as_posix())
    return sorted(out)


def _stat(f: Path) -> tuple[int, int]:
    st = f.stat()
    return st.st_size, st.st_mtime_ns


def _cache_file(src: Path) -> Path | None:
    from artifacts import shared_cache

    root = shared_cache.cache_root()
    if root is None:
        return None
    return root / "checkpoint-hashes" / (hashlib.sha256(str(src).encode()).hexdigest()[:24] + ".json")


def _read_cache(path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        return data.get("files", {}) if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # a torn or foreign file: hash again


def _write_cache(path: Path | None, src: Path, files: dict) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"path": str(src), "files": files}, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # the cache is an accelerator only


def digest_of(files: dict) -> str:
    """The checkpoint digest: sha256 over sorted (relative name, file sha256)."""
    h = hashlib.sha256(b"checkpoint-digest-v1\n")
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + files[rel]["sha256"].encode() + b"\n")
    return h.hexdigest()


def hash_checkpoint(src: str | Path, known: dict | None = None) -> dict:
    """{"path", "digest", "files": {rel: {"size", "mtime_ns", "sha256"}}, "hashed": [rels read this time]}.

    A file whose (size, mtime) equals its entry in `known` or in the shared hash cache is not read again."""
    src = Path(src).resolve()
    if not src.is_dir():
        raise FileNotFoundError(f"model.path {src} is not a directory: give a local checkpoint directory (a Hugging "
                                f"Face snapshot with config.json and *.safetensors)")
    names = checkpoint_files(src)
    if not names:
        raise FileNotFoundError(f"model.path {src} holds no files: give a local checkpoint directory")
    cache_path = _cache_file(src)
    cached = {**_read_cache(cache_path), **(known or {})}
    files, hashed = {}, []
    for rel in names:
        size, mtime = _stat(src / rel)
        old = cached.get(rel)
        if old and old.get("size") == size and old.get("mtime_ns") == mtime and old.get("sha256"):
            files[rel] = {"size": size, "mtime_ns": mtime, "sha256": old["sha256"]}
            continue
        files[rel] = {"size": size, "mtime_ns": mtime, "sha256": sha256_file(src / rel)}
        hashed.append(rel)
    if hashed:
        _write_cache(cache_path, src, files)
    return {"path": str(src), "digest": digest_of(files), "files": files, "hashed": hashed}


def write_ref(target: Path, record: dict) -> None:
    """The run's sealed reference directory `target` (one verified JSON file)."""
    scratch = target.with_name(target.name + ".build")
    if scratch.exists():
        shutil.rmtree(scratch)
    body = {"version": REF_VERSION, "path": record["path"], "digest": record["digest"], "files": record["files"]}
    atomic_write(scratch / REF_NAME, lambda tmp: tmp.write_text(json.dumps(body, indent=1, sort_keys=True)))
    if target.exists():
        shutil.rmtree(target)
    scratch.rename(target)


def read_ref(path: str | Path) -> dict | None:
    """The reference record of a run's base directory, or None when `path` is a checkpoint or recipe itself."""
    f = Path(path) / REF_NAME
    if not f.is_file():
        return None
    verify(f)
    return read_json(f)


def check_unchanged(ref: dict) -> dict:
    """Check the referenced checkpoint against the record (stat first, hash only what changed); the current state.

    Raises CheckpointChanged with the first file that differs, is missing or was added."""
    src = Path(ref["path"])
    hint = ("a run trains only on the checkpoint it recorded: restore the checkpoint (same files, same bytes), or "
            "start a new run (a new --run-dir) to train on the changed one")
    if not src.is_dir():
        raise CheckpointChanged(src, "the checkpoint this run recorded is gone (moved or deleted)", hint)
    names = checkpoint_files(src)
    recorded = ref["files"]
    missing = sorted(set(recorded) - set(names))
    added = sorted(set(names) - set(recorded))
    if missing:
        raise CheckpointChanged(src / missing[0], f"file of the recorded checkpoint is missing ({len(missing)} in all)",
                                hint)
    if added:
        raise CheckpointChanged(src / added[0], f"file was added to the checkpoint after this run recorded it "
                                                f"({len(added)} in all)", hint)
    now = hash_checkpoint(src, known=recorded)
    for rel in now["hashed"]:
        if now["files"][rel]["sha256"] != recorded[rel]["sha256"]:
            raise CheckpointChanged(src / rel, "file changed since this run recorded it (other bytes: sha256 "
                                               f"{recorded[rel]['sha256'][:12]}... -> {now['files'][rel]['sha256'][:12]}...)",
                                    hint)
    return now


def resolve(path: str | Path) -> Path:
    """The directory to load a base from: the referenced checkpoint (checked unchanged) or `path` itself."""
    ref = read_ref(path)
    if ref is None:
        return Path(path)
    check_unchanged(ref)
    return Path(ref["path"])


def check_run(run_dir: str | Path) -> list[str]:
    """Check every checkpoint a run references (<run>/bootstrap/pretrained-*) before it starts or resumes: a
    changed one stops the run with CheckpointChanged before any task runs. Returns the checked checkpoint paths."""
    checked = []
    for d in sorted((Path(run_dir) / "bootstrap").glob("pretrained-*")):
        ref = read_ref(d)
        if ref is not None:
            check_unchanged(ref)
            checked.append(ref["path"])
    return checked
