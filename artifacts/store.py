"""Storage primitives: atomic writes with a verified sha256 sidecar.

Every artifact ``<name>`` is written to a temporary file in the same directory, flushed, fsynced and
moved into place with ``os.replace``; next to it lives ``<name>.sha256`` holding the hex digest and the
byte size. Readers call :func:`verify` first, so a truncated or corrupted file raises
:class:`ArtifactError` naming the file instead of being parsed.

Formats: Arrow IPC files for tables, safetensors for tensors, JSON for small documents, JSON Lines for
append-only histories (the only format without a sidecar: it grows in place).

torch and safetensors are imported inside the functions that need them, so ``import artifacts`` stays
torch-free (``configs/`` and ``flows/`` must not import torch at module level).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    import torch

PathLike = str | os.PathLike[str]

SIDECAR_SUFFIX = ".sha256"
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"

_TMP_MARK = ".tmp-"
_FIX_HINT = "delete it and re-run the stage that wrote it"
_MISSING_HINT = "re-run the stage that writes it"


class ArtifactError(RuntimeError):
    """An artifact is missing, truncated, corrupted or unreadable.

    ``path`` is the offending file; the message names it and says how to recover.
    """

    def __init__(self, path: PathLike, problem: str, hint: str = _FIX_HINT) -> None:
        self.path = Path(path)
        super().__init__(f"{self.path}: {problem}; {hint}")


# --------------------------------------------------------------------------------------------------
# hashing, sidecars, atomic replace
# --------------------------------------------------------------------------------------------------


def sha256_file(path: PathLike) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sidecar_path(path: PathLike) -> Path:
    """The checksum sidecar of an artifact: ``<name>.sha256`` next to it."""
    p = Path(path)
    return p.with_name(p.name + SIDECAR_SUFFIX)


def _temp_path(path: Path) -> Path:
    """A unique hidden temporary name in the same directory (so ``os.replace`` is a rename)."""
    return path.with_name(f".{path.name}{_TMP_MARK}{uuid.uuid4().hex[:12]}")


def _is_temp_name(name: str) -> bool:
    return name.startswith(".") and _TMP_MARK in name


def _fsync_dir(directory: Path) -> None:
    """Make renames inside ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_and_fsync(path: Path) -> tuple[str, int]:
    """fsync a freshly written file and return (sha256, size) of what is on disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        size = os.fstat(f.fileno()).st_size
    return digest, size


def _write_bytes_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path: PathLike, write: Callable[[Path], None]) -> str:
    """Write an artifact atomically and record its sidecar; returns the sha256 hex digest.

    ``write(tmp)`` must create the file ``tmp`` (a temporary name in the target directory). If it
    raises, or anything before the final renames fails, the temporary files are removed and the
    previous version of the artifact (data + sidecar) is left untouched. The data file and the sidecar
    are renamed into place back to back; a crash exactly between the two renames leaves a file whose
    sidecar does not match, which :func:`verify` reports (never a silently wrong read).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    side = sidecar_path(target)
    tmp, tmp_side = _temp_path(target), _temp_path(side)
    try:
        write(tmp)
        if not tmp.is_file():
            raise RuntimeError(f"writer for {target} did not create its temporary file {tmp}")
        digest, size = _hash_and_fsync(tmp)
        _write_bytes_synced(tmp_side, f"{digest} {size}\n".encode())
        os.replace(tmp, target)
        os.replace(tmp_side, side)
    finally:
        tmp.unlink(missing_ok=True)
        tmp_side.unlink(missing_ok=True)
    _fsync_dir(target.parent)
    return digest


def _read_sidecar(side: Path) -> tuple[str, int]:
    fields = side.read_text(encoding="ascii", errors="replace").split()
    valid = (
        len(fields) == 2
        and len(fields[0]) == 64
        and all(c in "0123456789abcdef" for c in fields[0])
        and fields[1].isdigit()
    )
    if not valid:
        raise ArtifactError(
            side, "checksum sidecar is malformed (expected '<sha256 hex> <size>')", _FIX_HINT + " (and this sidecar)"
        )
    return fields[0], int(fields[1])


def sidecar_digest(path: PathLike) -> str:
    """The sha256 an artifact's sidecar records (the file itself is not read: see :func:`verify` for that)."""
    side = sidecar_path(path)
    if not side.is_file():
        raise ArtifactError(Path(path), f"checksum sidecar {side.name} is missing")
    return _read_sidecar(side)[0]


def verify(path: PathLike) -> str:
    """Check an artifact against its sidecar; returns its sha256 hex digest (usable as a cache key).

    Raises :class:`ArtifactError` when the file or its sidecar is missing, when the size differs
    (truncated / partially written) or when the content hash differs (corrupted).
    """
    p = Path(path)
    if not p.is_file():
        raise ArtifactError(p, "artifact is missing", _MISSING_HINT)
    side = sidecar_path(p)
    if not side.is_file():
        raise ArtifactError(
            p,
            f"checksum sidecar {side.name} is missing, so the file cannot be verified "
            "(interrupted write, or not written by artifacts.store)",
        )
    expected_digest, expected_size = _read_sidecar(side)
    size = p.stat().st_size
    if size < expected_size:
        raise ArtifactError(p, f"file is truncated: size is {size} bytes, {side.name} records {expected_size}")
    if size > expected_size:
        raise ArtifactError(p, f"file size is {size} bytes, {side.name} records {expected_size} (extra bytes)")
    digest = sha256_file(p)
    if digest != expected_digest:
        raise ArtifactError(
            p, f"file is corrupted: sha256 {digest[:16]}... differs from {expected_digest[:16]}... in {side.name}"
        )
    return digest


_VERIFIED: dict[str, tuple[tuple, str]] = {}  # path -> (stat signature of file and sidecar, digest)
# A file whose timestamps are this much older than its hash is settled (see verified_digest): file timestamps come
# from the kernel's coarse clock (one tick, at most 10 ms at HZ=100); on a file system that keeps whole seconds only,
# two seconds.
_SETTLED_NS, _SETTLED_WHOLE_SECONDS_NS = 100_000_000, 2_000_000_000


def _stat_signature(p: PathLike) -> tuple:
    name = os.fspath(p)  # sidecar_path's name, without building Paths: every input of every task's cache key
    st, sd = os.stat(name), os.stat(name + SIDECAR_SUFFIX)
    return tuple((x.st_dev, x.st_ino, x.st_size, x.st_mtime_ns, x.st_ctime_ns) for x in (st, sd))


def verified_digest(path: PathLike) -> str:
    """:func:`verify`, remembered in this process while the file and its sidecar keep the same device, inode, size,
    mtime and ctime (for content-keyed caches that ask for the same artifacts many times: Prefect's cache keys hash
    every input artifact of every task).

    Any write to the file or sidecar -- in place, or an atomic replace (a new inode) -- changes that signature
    (ctime cannot be set back from user space), so the file is hashed and verified again. A digest is remembered
    only when the timestamps of file and sidecar were older than ``_SETTLED_NS`` when it was first looked at: file
    timestamps come from a coarse clock, so a write within the same tick as the remembered one could otherwise keep
    the signature (the "racy" case git's index also guards against). Readers of artifacts keep calling :func:`verify`."""
    p = Path(path)
    # the key only names the entry: what makes a hit is the stat signature (device and inode of file and sidecar
    # included), so a path reached another way (a symlink, another working directory) at worst hashes once more.
    # No resolve(): it costs an lstat per path component, on every input of every task's cache key.
    key = os.path.abspath(p)
    t0 = time.time_ns()  # settled is judged at the first stat: a write after it gets a later timestamp
    try:
        before = _stat_signature(p)
    except OSError:
        return verify(p)  # missing file or sidecar: verify names it
    hit = _VERIFIED.get(key)
    if hit is not None and hit[0] == before:
        return hit[1]
    digest = verify(p)
    try:
        after = _stat_signature(p)
    except OSError:
        after = None
    stamps = [t for x in before for t in (x[3], x[4])]
    settled = _SETTLED_WHOLE_SECONDS_NS if all(t % 1_000_000_000 == 0 for t in stamps) else _SETTLED_NS
    if after == before and t0 - max(stamps) > settled:
        if len(_VERIFIED) >= 65536:  # a long run: forget the old steps' files (they are hashed again if asked)
            _VERIFIED.clear()
        _VERIFIED[key] = (before, digest)
    else:
        _VERIFIED.pop(key, None)
    return digest


def content_digest(path: PathLike) -> str:
    """Digest of an artifact file (:func:`verified_digest`) or directory (:func:`dir_digest` over verified
    digests): what a content-keyed cache hashes."""
    p = Path(path)
    return dir_digest(p, verified_digest) if p.is_dir() else verified_digest(p)


# --------------------------------------------------------------------------------------------------
# Arrow tables
# --------------------------------------------------------------------------------------------------


def _ragged_to_arrow(name: str, rows: Sequence[np.ndarray]) -> pa.Array:
    """A list of 1-D arrays -> list<T>; a list of (K_i, D) arrays -> list<fixed_size_list<T, D>>."""
    ndims = {r.ndim for r in rows}
    dtypes = {r.dtype for r in rows}
    if len(ndims) != 1 or len(dtypes) != 1:
        raise ValueError(f"column {name!r}: ragged rows must share ndim and dtype, got {ndims} / {dtypes}")
    ndim = ndims.pop()
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise ValueError(f"column {name!r}: {offsets[-1]} values exceed int32 list offsets; split the table")
    flat = np.concatenate([np.ascontiguousarray(r) for r in rows])
    if ndim == 1:
        values = pa.array(flat)
    elif ndim == 2:
        widths = {r.shape[1] for r in rows}
        if len(widths) != 1:
            raise ValueError(f"column {name!r}: 2-D rows must share their last dimension, got {sorted(widths)}")
        values = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), widths.pop())
    else:
        raise ValueError(f"column {name!r}: ragged rows must be 1-D or 2-D arrays, got {ndim}-D")
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)


def _to_arrow_column(name: str, values: Any, type_: pa.DataType | None) -> pa.Array | pa.ChunkedArray:
    """Convert one column. numpy keeps its dtype; ``type_`` (from ``schema``) casts safely."""
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        column = values
    elif isinstance(values, np.ndarray):
        if values.ndim == 1:
            column = pa.array(values)
        elif values.ndim == 2:
            flat = pa.array(np.ascontiguousarray(values).reshape(-1))
            column = pa.FixedSizeListArray.from_arrays(flat, values.shape[1])
        else:
            raise ValueError(f"column {name!r}: numpy columns must be 1-D or 2-D, got shape {values.shape}")
    elif len(values) > 0 and all(isinstance(v, np.ndarray) for v in values):
        column = _ragged_to_arrow(name, values)
    else:
        return pa.array(values, type=type_)
    if type_ is not None and column.type != type_:
        column = column.cast(type_)
    return column


def _build_table(columns: Mapping[str, Any], schema: pa.Schema | None) -> pa.Table:
    if schema is not None and set(schema.names) != set(columns):
        missing, extra = sorted(set(schema.names) - set(columns)), sorted(set(columns) - set(schema.names))
        raise ValueError(f"columns do not match schema: missing {missing}, unexpected {extra}")
    names = schema.names if schema is not None else list(columns)
    arrays = {n: _to_arrow_column(n, columns[n], schema.field(n).type if schema else None) for n in names}
    lengths = {n: len(a) for n, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"columns have different row counts: {lengths}")
    return pa.table(arrays, metadata=schema.metadata if schema is not None else None)


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    metadata = dict(metadata or {})
    bad = {k: type(v).__name__ for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad:
        raise TypeError(f"metadata keys and values must be str (json.dumps other values); offending: {bad}")
    return metadata


def write_table(
    path: PathLike,
    columns: Mapping[str, Any] | pa.Table,
    metadata: Mapping[str, str] | None = None,
    schema: pa.Schema | None = None,
) -> str:
    """Write an Arrow IPC file atomically; returns its sha256.

    ``columns`` maps names to a 1-D numpy array (dtype kept), a 2-D numpy array ``(N, D)`` (stored as
    ``fixed_size_list<T, D>``), a list of 1-D numpy arrays (``list<T>``, e.g. token ids as int32), a list
    of ``(K_i, D)`` numpy arrays (``list<fixed_size_list<T, D>>``, e.g. thought vectors), a pyarrow array,
    or a plain Python list (type inferred; pass ``schema`` to pin types, e.g. for zero-row tables).
    A ``pa.Table`` is written as is (cast to ``schema`` when given). ``metadata`` (str -> str) is merged
    into the schema metadata.
    """
    if isinstance(columns, pa.Table):
        table = columns if schema is None else columns.select(schema.names).cast(schema)
    else:
        table = _build_table(columns, schema)
    merged = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    merged.update(_check_metadata(metadata))
    table = table.replace_schema_metadata(merged or None)

    def write(tmp: Path) -> None:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)

    return atomic_write(path, write)


def read_table(path: PathLike) -> pa.Table:
    """Verify, then read an Arrow IPC file fully into memory."""
    verify(path)
    with pa.OSFile(str(path), "rb") as source:
        return pa.ipc.open_file(source).read_all()


def table_metadata(table: pa.Table) -> dict[str, str]:
    """The schema metadata of a table as ``str -> str``."""
    return {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}


def _combined(table: pa.Table, column: str) -> pa.Array:
    array = table.column(column).combine_chunks()
    if array.null_count:
        raise ValueError(f"column {column!r} has {array.null_count} nulls; cannot convert to tensors")
    return array


def to_tensor(table: pa.Table, column: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A primitive column -> ``(N,)``; a ``fixed_size_list<T, D>`` column -> ``(N, D)``. Copies."""
    import torch

    array = _combined(table, column)
    if pa.types.is_fixed_size_list(array.type):
        width = array.type.list_size
        flat = array.flatten().to_numpy(zero_copy_only=False)
        out = torch.from_numpy(flat.copy()).reshape(len(array), width)
    else:
        out = torch.from_numpy(array.to_numpy(zero_copy_only=False).copy())
    return out if dtype is None else out.to(dtype)


def to_tensor_list(table: pa.Table, column: str, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """A ``list<T>`` column -> one 1-D tensor per row; ``list<fixed_size_list<T, D>>`` -> ``(K_i, D)``.

    The rows are views into one contiguous copy of the column's values.
    """
    import torch

    array = _combined(table, column)
    if not pa.types.is_list(array.type):
        raise TypeError(f"column {column!r} has type {array.type}, expected a list column")
    lengths = array.value_lengths().to_numpy(zero_copy_only=False).tolist()
    values = array.flatten()
    if pa.types.is_fixed_size_list(values.type):
        width = values.type.list_size
        flat = torch.from_numpy(values.flatten().to_numpy(zero_copy_only=False).copy()).reshape(-1, width)
    else:
        flat = torch.from_numpy(values.to_numpy(zero_copy_only=False).copy())
    if dtype is not None:
        flat = flat.to(dtype)
    return list(torch.split(flat, lengths))


# --------------------------------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------------------------------


def write_tensors(
    path: PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> str:
    """Write tensors to a safetensors file atomically (bitwise, any dtype); returns its sha256.

    Tensors must not share storage (safetensors refuses aliasing); non-contiguous ones are copied.
    """
    import torch
    from safetensors.torch import save_file

    bad = {k: type(v).__name__ for k, v in tensors.items() if not isinstance(v, torch.Tensor)}
    if bad:
        raise TypeError(f"write_tensors({path}): values must be torch.Tensor; offending: {bad}")
    plain = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    meta = _check_metadata(metadata)
    return atomic_write(path, lambda tmp: save_file(plain, str(tmp), metadata=meta or None))


def read_tensors(path: PathLike, device: str = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Verify, then load a safetensors file; returns ``(tensors, metadata)``."""
    from safetensors import safe_open

    verify(path)
    with safe_open(str(path), framework="pt", device=device) as f:
        metadata = dict(f.metadata() or {})
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    return tensors, metadata


# --------------------------------------------------------------------------------------------------
# JSON / JSON Lines
# --------------------------------------------------------------------------------------------------


def _json_default(obj: Any) -> Any:
    """Encode sets (sorted, for a stable hash), paths and numpy scalars; refuse anything else."""
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serializable: {obj!r}")


def dumps_json(obj: Any, indent: int | None = 2) -> str:
    """Deterministic JSON (sorted keys) as written by :func:`write_json` and :func:`append_jsonl`."""
    separators = None if indent is not None else (",", ":")
    return json.dumps(obj, indent=indent, sort_keys=True, default=_json_default, separators=separators)


def write_json(path: PathLike, obj: Any) -> str:
    """Write a JSON document atomically (sorted keys; sets become sorted lists); returns its sha256."""
    data = (dumps_json(obj) + "\n").encode()
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def read_json(path: PathLike) -> Any:
    """Verify, then parse a JSON document."""
    verify(path)
    return json.loads(Path(path).read_text(encoding="utf-8"))


def append_jsonl(path: PathLike, obj: Any, replace: str | None = None) -> None:
    """Append one JSON object as one line to a history file, then fsync.

    History files have no sidecar (they grow in place). Refuses to append after a torn last line
    (a crash mid-append) so that a bad record is never buried in the middle of the file.

    ``replace="step"``: a record with the same ``obj["step"]`` already in the file is dropped first (the file is
    rewritten atomically without it), so re-running or resuming a step keeps one record per step, the latest.
    """
    p = Path(path)
    line = (dumps_json(obj, indent=None) + "\n").encode()
    p.parent.mkdir(parents=True, exist_ok=True)
    if replace is not None and p.is_file():
        old = read_jsonl(p)
        kept = [r for r in old if not (isinstance(r, dict) and r.get(replace) == obj[replace])]
        if len(kept) != len(old):
            body = b"".join((dumps_json(r, indent=None) + "\n").encode() for r in kept) + line
            tmp = _temp_path(p)
            try:
                _write_bytes_synced(tmp, body)
                os.replace(tmp, p)
            finally:
                tmp.unlink(missing_ok=True)
            _fsync_dir(p.parent)
            return
    with open(p, "ab+") as f:
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                raise ArtifactError(
                    p, "last line is incomplete (interrupted append)", "remove the partial last line, then retry"
                )
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: PathLike) -> list[Any]:
    """Parse a JSON Lines history file; a bad line raises :class:`ArtifactError` naming file:line."""
    p = Path(path)
    if not p.is_file():
        raise ArtifactError(p, "history file is missing", _MISSING_HINT)
    records = []
    with open(p, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.endswith("\n"):
                raise ArtifactError(p, f"line {number} is incomplete (interrupted append)", "remove that line")
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ArtifactError(p, f"line {number} is not valid JSON ({e.msg})", "fix or remove that line") from e
    return records


# --------------------------------------------------------------------------------------------------
# directories (adapters)
# --------------------------------------------------------------------------------------------------


def dir_digest(path: PathLike, verify_file: Callable[[PathLike], str] | None = None) -> str:
    """sha256 over a directory of verified artifacts: sorted relative names and their digests.

    Every file (recursively) must verify; sidecars are covered through their artifacts, leftover
    temporary files from interrupted writes are ignored, and a sidecar without its artifact is an error.
    ``verify_file`` (default :func:`verify`) checks one file and returns its digest.
    """
    verify_file = verify_file or verify
    root = Path(path)
    if not root.is_dir():
        raise ArtifactError(root, "artifact directory is missing", _MISSING_HINT)
    entries = []
    for rel, file, names in sorted(_dir_files(root)):
        if rel.endswith(SIDECAR_SUFFIX):
            if rel.rpartition("/")[2][: -len(SIDECAR_SUFFIX)] not in names:
                raise ArtifactError(file, "sidecar without its artifact")
            continue
        entries.append((rel, verify_file(file)))
    if not entries:
        raise ArtifactError(root, "artifact directory is empty", _MISSING_HINT)
    return _dir_digest_of(entries)


def _dir_files(root: Path, prefix: str = ""):
    """(relative posix name, path, names of the regular files beside it) of every regular file under `root`,
    recursively, leftover temporary files of interrupted writes left out; symlinks followed like ``Path.rglob`` +
    ``is_file`` did (one scandir per directory: content-keyed caches list the same adapter and base directories for
    every task's key)."""
    files, dirs = [], []
    with os.scandir(root) as it:
        for e in it:
            if e.is_file():
                if not _is_temp_name(e.name):
                    files.append(e)
            elif e.is_dir(follow_symlinks=False):
                dirs.append(e)
    names = frozenset(e.name for e in files)
    for e in files:
        yield prefix + e.name, Path(e.path), names
    for e in dirs:
        yield from _dir_files(Path(e.path), prefix + e.name + "/")


def _dir_digest_of(entries) -> str:
    """The dir_digest of (relative name, file digest) pairs."""
    lines = sorted(f"{rel}\0{digest}\n" for rel, digest in entries)
    return hashlib.sha256("".join(["dir-digest-v1\n", *lines]).encode()).hexdigest()


def seal_dir(src: Path, dst: Path) -> str:
    """Copy every file of `src` into `dst` as verified artifacts (atomic, with sidecars); returns dir digest."""
    tmp = dst.with_name(dst.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    for f in sorted(src.rglob("*")):
        if f.is_file():
            atomic_write(tmp / f.relative_to(src), lambda t, f=f: shutil.copyfile(f, t))
    if dst.exists():
        shutil.rmtree(dst)
    tmp.rename(dst)
    return dir_digest(dst)


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the complete directory ``src`` to ``dst``, replacing an existing ``dst``.

    An existing ``dst`` is first renamed to a hidden backup, so at every instant one complete version
    exists on disk; the backup is deleted once the new directory is in place.
    """
    if not dst.exists():
        os.rename(src, dst)
        return
    if not dst.is_dir():
        raise ArtifactError(dst, "exists and is not a directory", "remove it, then retry")
    backup = dst.with_name(f".{dst.name}.old-{uuid.uuid4().hex[:12]}")
    os.rename(dst, backup)
    try:
        os.rename(src, dst)
    except OSError:
        os.rename(backup, dst)
        raise
    shutil.rmtree(backup)


def write_adapter_dir(
    path: PathLike, adapter_config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> str:
    """Write a PEFT adapter directory atomically; returns its :func:`dir_digest`.

    Layout: ``adapter_config.json`` + ``adapter_model.safetensors`` (+ their sidecars, which PEFT
    ignores), loadable with ``PeftModel.from_pretrained(model, path)``. ``adapter_config`` is e.g.
    ``peft_model.peft_config["default"].to_dict()`` (sets are stored as sorted lists); ``tensors`` is
    ``get_peft_model_state_dict(peft_model)``. Built in a temporary sibling directory, then renamed
    into place (an existing directory is replaced, never left half-written).
    """
    target = Path(path)
    if "peft_type" not in adapter_config:
        raise ValueError(f"adapter_config for {target} has no 'peft_type'; pass peft_config.to_dict()")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_path(target)
    tmp.mkdir()
    try:
        # the digests of what the writes hashed on disk: the directory's digest without reading its files again
        # (at the 27B shape the adapter is ~450 MB); the renamed directory keeps the same files
        entries = [(ADAPTER_CONFIG_NAME, write_json(tmp / ADAPTER_CONFIG_NAME, dict(adapter_config))),
                   (ADAPTER_WEIGHTS_NAME,
                    write_tensors(tmp / ADAPTER_WEIGHTS_NAME, tensors, metadata={"format": "pt"}))]
        _fsync_dir(tmp)
        _replace_dir(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    _fsync_dir(target.parent)
    return _dir_digest_of(entries)


def read_adapter_dir(path: PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Verify and read an adapter directory; returns ``(adapter_config, tensors)``."""
    root = Path(path)
    if not root.is_dir():
        raise ArtifactError(root, "adapter directory is missing", _MISSING_HINT)
    config = read_json(root / ADAPTER_CONFIG_NAME)
    tensors, _ = read_tensors(root / ADAPTER_WEIGHTS_NAME)
    return config, tensors
