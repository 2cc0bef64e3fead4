"""Artifact storage: atomic, hash-verified files (Arrow, safetensors, JSON) and the run-directory layout.

Importing this package does not import torch.
"""

from artifacts.layout import RunDir
from artifacts.store import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    SIDECAR_SUFFIX,
    ArtifactError,
    append_jsonl,
    atomic_write,
    dir_digest,
    dumps_json,
    read_adapter_dir,
    read_json,
    read_jsonl,
    read_table,
    read_tensors,
    sha256_file,
    sidecar_path,
    table_metadata,
    to_tensor,
    to_tensor_list,
    verify,
    write_adapter_dir,
    write_json,
    write_table,
    write_tensors,
)

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "SIDECAR_SUFFIX",
    "ArtifactError",
    "RunDir",
    "append_jsonl",
    "atomic_write",
    "dir_digest",
    "dumps_json",
    "read_adapter_dir",
    "read_json",
    "read_jsonl",
    "read_table",
    "read_tensors",
    "sha256_file",
    "sidecar_path",
    "table_metadata",
    "to_tensor",
    "to_tensor_list",
    "verify",
    "write_adapter_dir",
    "write_json",
    "write_table",
    "write_tensors",
]
