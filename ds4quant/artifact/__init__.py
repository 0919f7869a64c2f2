"""The artifact container: GGUF v3 writer and validating reader, per-tensor
qtype tags, manifest.json, and atomic file/folder writes.

    from ds4quant.artifact import GGUFWriter, read_gguf, read_gguf_set

    w = GGUFWriter("out/model.gguf", split_max_bytes=50 << 30)
    w.add_string("general.architecture", "deepseek4")
    w.add_tensor("blk.0.ffn_down_exps.weight", "rocmfp3", (2048, 4096, 256), data=produce)
    w.write()
    g = read_gguf_set("out/model-00001-of-00003.gguf")
"""

from ds4quant.artifact.atomic import (
    PARTIAL_MARK,
    AtomicFile,
    StalePartial,
    atomic_write,
    atomic_write_bytes,
    atomic_write_json,
    fsync_dir,
    clear_stale_partials,
    json_bytes,
    publish_dir,
)
from ds4quant.artifact.ds4 import REQUIRED_U32_KEYS, check_ds4_header, expert_shape
from ds4quant.artifact.gguf_reader import GGUFFile, GGUFSet, TensorInfo, read_gguf, read_gguf_set
from ds4quant.artifact.gguf_values import KV, make_kv
from ds4quant.artifact.gguf_writer import (
    DEFAULT_ALIGNMENT,
    GGUFPlan,
    GGUFWriter,
    PlannedFile,
    PlannedTensor,
    split_path,
)
from ds4quant.artifact.manifest import (
    SCHEMA_VERSION,
    FileEntry,
    Manifest,
    TensorEntry,
    manifest_from_json,
    read_manifest,
    sha256_bytes,
    sha256_file,
    tensor_entries,
    write_manifest,
)
from ds4quant.artifact.qtypes import VARIANTS_107, TypeRef, tensor_nbytes, type_ref, untagged_ref
from ds4quant.artifact.tags import FORMAT_VERSION, KEY_FORMAT_VERSION, KEY_VARIANTS, TAG_PREFIX, Tags, read_tags, tag_kvs

__all__ = [
    "AtomicFile", "atomic_write", "atomic_write_bytes", "atomic_write_json", "fsync_dir", "json_bytes",
    "publish_dir", "clear_stale_partials", "StalePartial", "PARTIAL_MARK",
    "REQUIRED_U32_KEYS", "check_ds4_header", "expert_shape",
    "GGUFFile", "GGUFSet", "TensorInfo", "read_gguf", "read_gguf_set",
    "KV", "make_kv",
    "DEFAULT_ALIGNMENT", "GGUFPlan", "GGUFWriter", "PlannedFile", "PlannedTensor", "split_path",
    "SCHEMA_VERSION", "FileEntry", "Manifest", "TensorEntry", "manifest_from_json", "read_manifest",
    "sha256_bytes", "sha256_file", "tensor_entries", "write_manifest",
    "VARIANTS_107", "TypeRef", "tensor_nbytes", "type_ref", "untagged_ref",
    "FORMAT_VERSION", "KEY_FORMAT_VERSION", "KEY_VARIANTS", "TAG_PREFIX", "Tags", "read_tags", "tag_kvs",
]
