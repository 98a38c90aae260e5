"""The on-disk format: what a sharded checkpoint is, independent of how it is read or written.

- :mod:`.names`: file names and patterns (vLLM's), the manifest and lock names;
- :mod:`.manifest`: ``sharded_state.json``, parsed from untrusted text;
- :mod:`.source`: the identity of the model a checkpoint was saved from;
- :mod:`.geometry`: how each tensor is split across tensor-parallel ranks;
- :mod:`.safetensors`: the safetensors header;
- :mod:`.untrusted`: strict JSON parsing shared by all of them.

Pure: no torch, no vLLM, no file I/O. The most used names are re-exported here.
"""

from .errors import (
    CheckpointCorrupt,
    CheckpointLocked,
    CheckpointMismatch,
    CheckpointNotFound,
    ConvertRefused,
    InvalidKey,
    InvalidOption,
    RankStopped,
    SaveFailedAfterPublish,
    SaveRefused,
    ShardedStateError,
    StorageError,
    Unsupported,
    WorkerLost,
    agreed_error,
)
from .manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    HASH_NAME,
    FileChecksum,
    FileEntry,
    Manifest,
    RankEntry,
    TensorEntry,
    check_manifest_consistency,
)
from .names import (
    DEFAULT_PATTERNS,
    LOCK_NAME,
    MANIFEST_NAME,
    PP_AND_TP_PATTERN,
    TP_ONLY_PATTERN,
    check_plain_file_name,
    default_pattern,
    parse_file_name,
    render_file_name,
    validate_pattern,
)
from .source import SourceModel, config_differences, config_sha256, normalize_config

__all__ = [
    "DEFAULT_PATTERNS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HASH_NAME",
    "LOCK_NAME",
    "MANIFEST_NAME",
    "PP_AND_TP_PATTERN",
    "TP_ONLY_PATTERN",
    "CheckpointCorrupt",
    "CheckpointLocked",
    "CheckpointMismatch",
    "CheckpointNotFound",
    "ConvertRefused",
    "FileChecksum",
    "FileEntry",
    "InvalidKey",
    "InvalidOption",
    "Manifest",
    "RankEntry",
    "RankStopped",
    "SaveFailedAfterPublish",
    "SaveRefused",
    "ShardedStateError",
    "SourceModel",
    "StorageError",
    "TensorEntry",
    "Unsupported",
    "WorkerLost",
    "agreed_error",
    "check_manifest_consistency",
    "check_plain_file_name",
    "config_differences",
    "config_sha256",
    "default_pattern",
    "normalize_config",
    "parse_file_name",
    "render_file_name",
    "validate_pattern",
]
