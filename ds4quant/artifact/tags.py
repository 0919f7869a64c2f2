"""Per-tensor format tags: the qtype of every tensor, written explicitly.

ggml type ids do not say which codec made a tensor (107 has three meanings,
105/106 collide between forks; docs/formats.md#type-107), so a
ds4quant GGUF carries, in every file of a set:

- ``ds4quant.format_version``  UINT32, currently 1;
- ``ds4quant.qtype.<tensor>``  STRING qtype name, one per tensor in that file
  (standard ggml types use their lowercase ggml name: "f32", "q8_0");
- ``ds4quant.qtype_variants``  ARRAY of STRING, sorted ``"<qtype>=<variant>"``
  entries, one per qtype used anywhere in the set (the variant is the
  registry's ``QType.variant``; a reader refuses a tag whose variant differs
  from the qtype of the same name in its own build).

On load the tag must agree with the tensor's ggml id (``rocmfp2_affine``
requires 107). Files without tags are read by id: standard ids and 100-106
resolve uniquely (105/106 as the Lucebox MIX types, which need codebooks);
107 is refused unless the caller names the variant.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional

from gguf import GGUFValueType as VT

from ds4quant.artifact.gguf_values import KV, make_kv
from ds4quant.artifact.qtypes import ID_AMBIGUOUS, VARIANTS_107, TypeRef, type_ref, untagged_ref
from ds4quant.errors import BadInputError, CorruptDataError, UnknownQTypeError, UnsupportedFormatError

FORMAT_VERSION = 1
KEY_FORMAT_VERSION = "ds4quant.format_version"
KEY_VARIANTS = "ds4quant.qtype_variants"
TAG_PREFIX = "ds4quant.qtype."
RESERVED_KEYS = (KEY_FORMAT_VERSION, KEY_VARIANTS)


def tag_key(tensor_name: str) -> str:
    return TAG_PREFIX + tensor_name


def variants_table(qtype_names: "list[str] | set[str] | tuple[str, ...]") -> KV:
    """The ``ds4quant.qtype_variants`` KV for these qtypes."""
    entries = sorted(f"{n}={type_ref(n).variant}" for n in set(qtype_names))
    return make_kv(entries, VT.ARRAY, VT.STRING, what=KEY_VARIANTS)


def tag_kvs(tensor_qtypes: Mapping[str, str], all_qtypes: "Optional[set[str]]" = None) -> dict[str, KV]:
    """Tag KVs for ``tensor_qtypes`` (tensor name -> qtype name), in order:
    format version, variants table (over ``all_qtypes`` if given, e.g. the
    whole split set, else over these tensors' qtypes), then one tag per tensor.
    """
    for name, q in tensor_qtypes.items():
        type_ref(q)  # unknown names raise here, before anything is written
    used = set(tensor_qtypes.values()) if all_qtypes is None else set(all_qtypes)
    out: dict[str, KV] = {
        KEY_FORMAT_VERSION: make_kv(FORMAT_VERSION, VT.UINT32),
        KEY_VARIANTS: variants_table(used),
    }
    for name, q in tensor_qtypes.items():
        out[tag_key(name)] = make_kv(q, VT.STRING, what=tag_key(name))
    return out


@dataclass(frozen=True)
class Tags:
    """The tags found in one file. ``format_version`` is None for foreign files."""

    format_version: Optional[int]
    qtypes: Mapping[str, str]  # tensor name -> qtype name
    variants: Mapping[str, str]  # qtype name -> variant

    @property
    def present(self) -> bool:
        return self.format_version is not None


def read_tags(kv: Mapping[str, KV], where: str, offsets: Optional[Mapping[str, int]] = None) -> Tags:
    """Collect and type-check the tag KVs of one file (no tensor checks yet).
    ``offsets`` (key -> byte offset of the KV) only enrich the messages."""

    def at(key: str) -> str:
        return f" (KV at byte {offsets[key]})" if offsets and key in offsets else ""

    qtypes: dict[str, str] = {}
    for key, val in kv.items():
        if key.startswith(TAG_PREFIX):
            if val.type != VT.STRING:
                raise CorruptDataError(f"tag {key!r} must be a STRING, got {val.type.name}{at(key)}", where=where)
            qtypes[key[len(TAG_PREFIX):]] = val.value
    fv = kv.get(KEY_FORMAT_VERSION)
    table = kv.get(KEY_VARIANTS)
    if fv is None:
        if qtypes or table is not None:
            first = next(iter(k for k in kv if k.startswith(TAG_PREFIX) or k == KEY_VARIANTS))
            raise CorruptDataError(f"ds4quant tags present but no {KEY_FORMAT_VERSION}{at(first)}", where=where)
        return Tags(None, MappingProxyType({}), MappingProxyType({}))
    if fv.type != VT.UINT32:
        raise CorruptDataError(f"{KEY_FORMAT_VERSION} must be UINT32, got {fv.type.name}{at(KEY_FORMAT_VERSION)}",
                               where=where)
    if fv.value != FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{KEY_FORMAT_VERSION} is {fv.value}; this build reads {FORMAT_VERSION}{at(KEY_FORMAT_VERSION)}",
            where=where, hint="upgrade ds4quant")
    if table is None:
        raise CorruptDataError(f"{KEY_VARIANTS} is missing", where=where)
    if table.type != VT.ARRAY or table.sub_type != VT.STRING:
        raise CorruptDataError(f"{KEY_VARIANTS} must be an ARRAY of STRING{at(KEY_VARIANTS)}", where=where)
    variants: dict[str, str] = {}
    for i, entry in enumerate(table.value):
        name, sep, variant = entry.partition("=")
        if not sep or not name or not variant:
            raise CorruptDataError(f"{KEY_VARIANTS}[{i}] = {entry!r} is not 'qtype=variant'{at(KEY_VARIANTS)}",
                                   where=where)
        if name in variants:
            raise CorruptDataError(f"{KEY_VARIANTS} lists {name!r} twice{at(KEY_VARIANTS)}", where=where)
        variants[name] = variant
    return Tags(fv.value, MappingProxyType(qtypes), MappingProxyType(variants))


def check_variant_107(variant_107: Optional[str]) -> None:
    if variant_107 is not None and variant_107 not in VARIANTS_107:
        raise BadInputError(f"variant_107 must be one of {', '.join(VARIANTS_107)}, got {variant_107!r}")


@dataclass(frozen=True)
class Resolved:
    ref: TypeRef
    source: str  # "tag", "ggml_type" or "variant_107"
    note: Optional[str] = None


def resolve_tensor(name: str, ggml_type: int, tags: Tags, variant_107: Optional[str], where: str) -> Resolved:
    """The qtype of one tensor from its tag, else from its id (see module doc)."""
    tag = tags.qtypes.get(name)
    if tag is not None:
        try:
            ref = type_ref(tag)
        except UnknownQTypeError:
            raise UnsupportedFormatError(
                f"tensor {name!r} is tagged with qtype {tag!r}, which this build does not know",
                where=where, hint="upgrade ds4quant") from None
        if ref.ggml_type != ggml_type:
            raise CorruptDataError(
                f"tensor {name!r} is tagged {tag!r} (ggml type {ref.ggml_type}) but stored as ggml type {ggml_type}",
                where=where)
        if tag not in tags.variants:
            raise CorruptDataError(f"{KEY_VARIANTS} has no entry for qtype {tag!r} (tensor {name!r})", where=where)
        if ref.decodable and tags.variants[tag] != ref.variant:
            raise UnsupportedFormatError(
                f"tensor {name!r}: the file's qtype {tag!r} is variant {tags.variants[tag]!r}, "
                f"this build's is {ref.variant!r}", where=where)
        if ggml_type == ID_AMBIGUOUS and variant_107 is not None and variant_107 != tag:
            raise BadInputError(
                f"tensor {name!r} is tagged {tag!r}, but variant_107={variant_107!r} was asked",
                where=where, hint="drop variant_107; tagged files say their variant")
        return Resolved(ref, "tag")
    if tags.present:
        raise CorruptDataError(f"tensor {name!r} has no {TAG_PREFIX}<name> tag", where=where)
    if ggml_type == ID_AMBIGUOUS and variant_107 is None:
        raise UnsupportedFormatError(
            f"tensor {name!r} has ggml type 107 and no tag; 107 means rocmfp2, rocmfp2_affine or rocmfp2_s40 "
            "depending on the build that wrote it",
            where=where, hint="name the variant (variant_107=...) if you know which build wrote the file")
    ref = untagged_ref(ggml_type, variant_107)
    if ref is None:  # the reader checks ids before resolving
        raise CorruptDataError(f"tensor {name!r} has unknown ggml type {ggml_type}", where=where)
    if ggml_type == ID_AMBIGUOUS:
        return Resolved(ref, "variant_107", f"tensor {name!r}: untagged type 107 read as {ref.name} (as asked)")
    if ref.needs_codebooks:
        return Resolved(ref, "ggml_type",
                        f"tensor {name!r}: untagged type {ggml_type} read as {ref.name} (Lucebox MIX); "
                        "it needs out-of-band codebooks, and other forks use this id for TurboQuant")
    return Resolved(ref, "ggml_type")
