"""Read a DeepSeek-V4 checkpoint folder in the official layout, one tensor at a time.

    src = open_source("samples/ds4-tiny")
    src.config.n_routed_experts                      # 16
    w = src.read_dequantized("layers.2.ffn.experts.5.w1.weight")   # float32 (128, 256)
    codes, scales = src.expert_fp4(2, 5, "w1")       # raw, for lossless MXFP4 repacking

A folder holds ``config.json`` and either ``model.safetensors.index.json`` plus
the shards it names, or one ``model.safetensors``. Opening validates, before
any tensor data is read:

1. config.json parses (native DeepSeek or transformers keys; ``parse_config``);
2. the index: every shard it names is a plain file name that exists; every
   tensor it lists is in that shard; every tensor of every shard is listed, in
   that shard; every shard passes the safetensors checks (``SafetensorsFile``);
3. encodings: an ``I8``/``F4`` weight with an ``F8_E8M0`` ``.scale`` of shape
   [out, in/32] is FP4 e2m1 (official experts); an ``F8_E4M3`` weight with an
   ``F8_E8M0`` ``.scale`` on the weight_block_size grid is block FP8; a
   ``.scale`` without its weight is refused;
4. shapes against config.json: embeddings, norms, attention projections,
   hyper-connection parameters, router, hash tables, shared and routed experts
   (logical [out, in]); layer and expert indices in range; every layer has all
   n_routed_experts x {w1, w2, w3}. All offenders are collected; the error
   names the first and counts the rest.

Tensors are memory-mapped: ``read`` returns a read-only view; ``read_dequantized``
decodes one tensor to float32 exactly (FP4: e2m1 x 2^(e-127) per 32 inputs, low
nibble first; FP8: e4m3 x 2^(e-127) per 128x128 block; bf16/f16/f32 as is).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Iterable, Iterator, Optional

import numpy as np

from ds4quant.errors import BadInputError, CorruptDataError, ShapeError, UnsupportedFormatError
from ds4quant.formats.fp8 import (
    E4M3,
    E8M0,
    FP4_BLOCK,
    check_e8m0_finite,
    dequant_e2m1_blocks,
    dequant_fp8_blocks,
)
from ds4quant.sources.config import CSA, HASH_MOE, Ds4Config, parse_config
from ds4quant.sources.naming import Kind, Mapped, NameMap, Skipped, map_names
from ds4quant.sources.safetensors_file import SafetensorsFile

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FINGERPRINT_VERSION = "ds4quant-source-fingerprint/1"

# tensor encodings in an official checkpoint
ENC_FP4 = "fp4_e2m1"  # I8 [out, in/2] (or F4 [out, in]) + F8_E8M0 scale [out, in/32]
ENC_FP8 = "fp8_e4m3"  # F8_E4M3 [out, in] + F8_E8M0 scale per block
ENC_SCALE = "e8m0_scale"  # the .scale of an FP4/FP8 weight
ENC_PLAIN = "plain"  # stored as its dtype (bf16, f32, i64, ...)

_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_EXPERT_WHICH = {"w1": "w1", "w2": "w2", "w3": "w3", "gate": "w1", "up": "w3", "down": "w2"}


@dataclass(frozen=True)
class TensorInfo:
    """What the source holds for one tensor (no data).

    dtype/shape: as stored (safetensors tag, element shape; F4 counts values).
    shape_logical: the weight's value shape (FP4 I8 [out, in/2] -> [out, in]).
    encoding: ENC_FP4 / ENC_FP8 / ENC_SCALE / ENC_PLAIN; scale: the companion
    scale tensor's name for FP4/FP8 weights.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str
    nbytes: int
    encoding: str
    shape_logical: tuple[int, ...]
    scale: Optional[str] = None
    weight: Optional[str] = None  # for a scale: the weight it belongs to


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _read_json(path: Path, what: str):
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise BadInputError(f"no {what}", where=str(path.parent),
                            hint="expected a DeepSeek-V4 checkpoint folder") from None
    try:
        return raw, json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptDataError(f"{what} is not valid JSON ({e})", where=str(path)) from None


def expected_shape(c: Ds4Config, m: Mapped) -> Optional[tuple[tuple[int, ...], str]]:
    """Logical shape the config implies for a mapped weight, with the config keys used
    (one table for both sources), or None for a tensor the table does not cover."""
    H, V, I, E = c.hidden_size, c.vocab_size, c.moe_intermediate_size, c.n_routed_experts
    hc, nh, hd = c.hc_mult, c.num_attention_heads, c.head_dim
    rest = m.name.split(".", 2)[2] if m.layer is not None else m.name
    rest = rest[: -len(".weight")] if rest.endswith(".weight") else rest
    glob = {
        "embed": ((V, H), "vocab_size, hidden_size"),
        "head": ((V, H), "vocab_size, hidden_size"),
        "norm": ((H,), "hidden_size"),
        "hc_head_fn": ((hc, hc * H), "hc_mult, hidden_size"),
        "hc_head_base": ((hc,), "hc_mult"),
        "hc_head_scale": ((1,), ""),
    }
    if m.layer is None:
        return glob.get(rest)
    if m.kind is Kind.ROUTED_EXPERT:
        shape = (H, I) if m.which == "down" else (I, H)
        return shape, "hidden_size, moe_intermediate_size"
    if m.kind is Kind.SHARED_EXPERT:
        Is = I * c.n_shared_experts
        return ((H, Is) if m.which == "down" else (Is, H)), "hidden_size, moe_intermediate_size x n_shared_experts"
    nhc = (2 + hc) * hc
    ltype = c.layer_types[m.layer] if m.layer < c.num_hidden_layers else None
    coff = 2 if ltype == CSA else 1  # CSA windows overlap: kv/gate/ape are twice as wide
    ratio = c.compress_ratios[m.layer] if m.layer < c.num_hidden_layers else 0
    ihd = c.index_head_dim
    table = {
        "attn_norm": ((H,), "hidden_size"),
        "ffn_norm": ((H,), "hidden_size"),
        "hc_attn_fn": ((nhc, hc * H), "hc_mult, hidden_size"),
        "hc_ffn_fn": ((nhc, hc * H), "hc_mult, hidden_size"),
        "hc_attn_base": ((nhc,), "hc_mult"),
        "hc_ffn_base": ((nhc,), "hc_mult"),
        "hc_attn_scale": ((3,), ""),
        "hc_ffn_scale": ((3,), ""),
        "attn.wq_a": ((c.q_lora_rank, H), "q_lora_rank, hidden_size"),
        "attn.q_norm": ((c.q_lora_rank,), "q_lora_rank"),
        "attn.wq_b": ((nh * hd, c.q_lora_rank), "num_attention_heads x head_dim, q_lora_rank"),
        "attn.wkv": ((hd, H), "head_dim, hidden_size"),
        "attn.kv_norm": ((hd,), "head_dim"),
        "attn.wo_a": ((c.o_groups * c.o_lora_rank, nh * hd // c.o_groups),
                      "o_groups x o_lora_rank, num_attention_heads x head_dim / o_groups"),
        "attn.wo_b": ((H, c.o_groups * c.o_lora_rank), "hidden_size, o_groups x o_lora_rank"),
        "attn.attn_sink": ((nh,), "num_attention_heads"),
        "attn.compressor.wkv": ((coff * hd, H), "head_dim (x2 for CSA), hidden_size"),
        "attn.compressor.wgate": ((coff * hd, H), "head_dim (x2 for CSA), hidden_size"),
        "attn.compressor.ape": ((ratio, coff * hd), "compress rate, head_dim (x2 for CSA)"),
        "attn.compressor.norm": ((hd,), "head_dim"),
        "attn.indexer.wq_b": ((c.index_n_heads * ihd, c.q_lora_rank),
                              "index_n_heads x index_head_dim, q_lora_rank"),
        "attn.indexer.weights_proj": ((c.index_n_heads, H), "index_n_heads, hidden_size"),
        "attn.indexer.compressor.wkv": ((2 * ihd, H), "2 x index_head_dim, hidden_size"),
        "attn.indexer.compressor.wgate": ((2 * ihd, H), "2 x index_head_dim, hidden_size"),
        "attn.indexer.compressor.ape": ((ratio, 2 * ihd), "compress rate, 2 x index_head_dim"),
        "attn.indexer.compressor.norm": ((ihd,), "index_head_dim"),
        "ffn.gate": ((E, H), "n_routed_experts, hidden_size"),
        "ffn.gate.bias": ((E,), "n_routed_experts"),
        "ffn.gate.tid2eid": ((V, c.num_experts_per_tok), "vocab_size, num_experts_per_tok"),
    }
    return table.get(rest)


class OfficialSource:
    """An open, validated official checkpoint (implements ``sources.base.Source``). Use ``open_source``."""

    format = "deepseek-v4-official"

    def __init__(self, path: Path, config: Ds4Config, files: dict[str, SafetensorsFile],
                 where: dict[str, str], fingerprint: str):
        self.path = path
        self.config = config
        self._files = files
        self._where = where  # tensor -> shard file name
        self._fingerprint = fingerprint
        self._infos = self._classify()
        self.names: NameMap = map_names(self._infos)
        self._check_shapes()

    @property
    def name(self) -> str:
        """The checkpoint folder's name."""
        return self.path.resolve().name

    # -- structure -------------------------------------------------------------

    def _classify(self) -> "MappingProxyType[str, TensorInfo]":
        raw = {n: self._files[s].entry(n) for n, s in self._where.items()}
        infos: dict[str, TensorInfo] = {}
        scale_of: dict[str, str] = {}
        for name in raw:
            for suffix in _SCALE_SUFFIXES:
                if name.endswith(suffix):
                    weight = name[: -len(suffix)] + ".weight" if suffix == ".scale" else name[: -len("_scale_inv")]
                    if weight not in raw:
                        raise CorruptDataError(f"scale tensor without its weight {weight!r}",
                                               where=self._tw(name))
                    if raw[name].dtype != "F8_E8M0":
                        raise UnsupportedFormatError(f"scale dtype {raw[name].dtype}; expected F8_E8M0",
                                                     where=self._tw(name))
                    if weight in scale_of:
                        raise CorruptDataError(f"{weight!r} has two scales", where=self._tw(name))
                    scale_of[weight] = name
        weight_of = {s: w for w, s in scale_of.items()}
        for name, e in raw.items():
            shard = self._where[name]
            if name in weight_of:
                weight = weight_of[name]
                infos[name] = TensorInfo(name, e.dtype, e.shape, shard, e.nbytes, ENC_SCALE, e.shape, weight=weight)
                continue
            sname = scale_of.get(name)
            if sname is None:
                if e.dtype == "F4":
                    raise CorruptDataError("F4 weight without its .scale", where=self._tw(name))
                infos[name] = TensorInfo(name, e.dtype, e.shape, shard, e.nbytes, ENC_PLAIN, e.shape)
                continue
            s = raw[sname]
            if e.dtype in ("I8", "F4"):
                if len(e.shape) != 2:
                    raise ShapeError(f"FP4 weight must be 2-D, got {e.shape}", where=self._tw(name))
                out = e.shape[0]
                cols = e.shape[1] * (2 if e.dtype == "I8" else 1)
                if cols % FP4_BLOCK or s.shape != (out, cols // FP4_BLOCK):
                    raise ShapeError(
                        f"FP4 weight {e.dtype} {e.shape} (values {out}x{cols}) needs scale ({out}, {cols // FP4_BLOCK})"
                        f", got {s.shape}", where=self._tw(name))
                infos[name] = TensorInfo(name, e.dtype, e.shape, shard, e.nbytes, ENC_FP4, (out, cols), scale=sname)
            elif e.dtype == "F8_E4M3":
                block = self.config.fp8_block or (128, 128)
                if len(e.shape) != 2:
                    raise ShapeError(f"FP8 weight must be 2-D, got {e.shape}", where=self._tw(name))
                grid = (-(-e.shape[0] // block[0]), -(-e.shape[1] // block[1]))
                if s.shape != grid:
                    raise ShapeError(f"FP8 weight {e.shape} with {block[0]}x{block[1]} blocks needs scale {grid}, "
                                     f"got {s.shape}", where=self._tw(name))
                infos[name] = TensorInfo(name, e.dtype, e.shape, shard, e.nbytes, ENC_FP8, e.shape, scale=sname)
            else:
                raise UnsupportedFormatError(f"{e.dtype} weight with an E8M0 scale is not a known encoding",
                                             where=self._tw(name))
        return MappingProxyType(infos)

    def _tw(self, name: str) -> str:
        return f"{self.path / self._where.get(name, '?')}: tensor {name!r}"

    def _check_shapes(self) -> None:
        c = self.config
        problems: list[tuple[str, str]] = []
        experts: dict[int, set] = {}
        for m in self.names.mapped:
            if m.layer is not None and m.layer >= c.num_hidden_layers:
                problems.append((m.name, f"layer {m.layer} but config.json has num_hidden_layers={c.num_hidden_layers}"))
                continue
            if m.expert is not None and m.expert >= c.n_routed_experts:
                problems.append((m.name, f"expert {m.expert} but config.json has n_routed_experts={c.n_routed_experts}"))
                continue
            if m.role != "weight":
                continue
            if m.expert is not None:
                experts.setdefault(m.layer, set()).add((m.expert, m.which))
            if m.kind is Kind.HASH_TABLE and c.mlp_layer_types[m.layer] != HASH_MOE:
                problems.append((m.name, f"hash table in layer {m.layer}, which config.json routes by score"))
            exp = expected_shape(c, m)
            if exp is None:
                continue
            want, keys = exp
            got = self._infos[m.name].shape_logical
            if tuple(got) != tuple(want):
                stored = self._infos[m.name]
                extra = f" (stored {stored.dtype} {stored.shape})" if stored.shape != got else ""
                problems.append((m.name, f"shape {tuple(got)}{extra} does not match config.json: expected "
                                         f"{tuple(want)} from {keys}"))
        for layer in range(c.num_hidden_layers):
            have = experts.get(layer, set())
            for e in range(c.n_routed_experts):
                for w, which in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
                    if (e, which) not in have:
                        problems.append((f"layers.{layer}.ffn.experts.{e}.{w}.weight",
                                         f"missing: config.json has n_routed_experts={c.n_routed_experts}"))
        if problems:
            problems.sort(key=lambda p: _natural_key(p[0]))
            name, why = problems[0]
            more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
            raise ShapeError(why + more, where=self._tw(name) if name in self._where else f"{self.path}: tensor {name!r}")

    # -- public API --------------------------------------------------------------

    def tensor_names(self) -> list[str]:
        """Every tensor in the checkpoint (weights and scales), in natural order."""
        return sorted(self._infos, key=_natural_key)

    def weight_names(self) -> list[str]:
        """Mapped value tensors (no scales, nothing skipped), in natural order."""
        return sorted((m.name for m in self.names.mapped if m.role == "weight"), key=_natural_key)

    @property
    def skipped(self) -> tuple[Skipped, ...]:
        """Tensors with no GGUF name (e.g. mtp.*), each with the reason."""
        return self.names.skipped

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise BadInputError("no such tensor in the checkpoint", where=f"{self.path}: tensor {name!r}") from None

    def read(self, name: str) -> np.ndarray:
        """The raw stored tensor (read-only memmap view; BF16 as uint16 words,
        F8_* as uint8, I8 FP4 codes as int8, F4 as uint8 [.., last/2])."""
        info = self.info(name)
        return self._files[info.shard].read(name)

    def read_dequantized(self, name: str) -> np.ndarray:
        """float32 values of one tensor, exactly (a new, writable array)."""
        info = self.info(name)
        raw = self.read(name)
        if info.encoding == ENC_SCALE:
            self._check_scale(info.name, raw)
            return E8M0[raw]
        if info.encoding == ENC_FP4:
            scale = self.read(info.scale)
            self._check_scale(info.scale, scale)
            return dequant_e2m1_blocks(raw, scale, where=name)
        if info.encoding == ENC_FP8:
            scale = self.read(info.scale)
            self._check_scale(info.scale, scale)
            block = self.config.fp8_block or (128, 128)
            if block[0] != block[1]:
                raise UnsupportedFormatError(f"FP8 block {block} is not square", where=self._tw(name))
            return dequant_fp8_blocks(raw, scale, block[0], where=name)
        dt = info.dtype
        if dt == "F32":
            return np.array(raw, dtype=np.float32)
        if dt == "BF16":
            words = raw.astype(np.uint32)
            words <<= np.uint32(16)  # in place: one float32-sized array, no second temporary
            return words.view(np.float32)
        if dt == "F16":
            return raw.astype(np.float32)
        if dt == "F8_E4M3":
            return E4M3[raw]
        if dt in ("I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64", "BOOL"):
            raise BadInputError(f"{dt} tensor holds integers, not weights; use read()", where=self._tw(name))
        raise UnsupportedFormatError(f"cannot dequantize {dt} exactly to float32", where=self._tw(name))

    def _check_scale(self, name: str, scale: np.ndarray) -> None:
        check_e8m0_finite(scale, where=self._tw(name))

    def iter_tensors(self, names: Optional[Iterable[str]] = None, *, dequantize: bool = False
                     ) -> Iterator[tuple[str, np.ndarray]]:
        """Yield (name, array) one tensor at a time (default: every mapped weight)."""
        for n in (self.weight_names() if names is None else names):
            yield n, (self.read_dequantized(n) if dequantize else self.read(n))

    def expert_fp4(self, layer: int, expert: int, which: str) -> tuple[np.ndarray, np.ndarray]:
        """Raw FP4 expert: (int8 codes (out, in/2), low nibble = even element;
        uint8 E8M0 scales (out, in/32)). which: w1/w2/w3 or gate/down/up."""
        if which not in _EXPERT_WHICH:
            raise BadInputError(f"which must be one of {sorted(_EXPERT_WHICH)}, got {which!r}")
        name = f"layers.{layer}.ffn.experts.{expert}.{_EXPERT_WHICH[which]}.weight"
        info = self.info(name)
        if info.encoding != ENC_FP4:
            raise UnsupportedFormatError(f"is stored as {info.dtype} ({info.encoding}), not FP4",
                                         where=self._tw(name))
        return self.read(name).view(np.int8), self.read(info.scale)

    def payload_qtype(self, name: str) -> None:
        """None: official encodings (FP4 + E8M0, FP8 blocks) are no ds4quant qtype."""
        self.info(name)
        return None

    def release(self, name: str) -> None:
        """Let the OS drop a tensor's (and its scale's) pages after use."""
        info = self.info(name)
        self._files[info.shard].release(name)
        if info.scale is not None:
            self._files[self._infos[info.scale].shard].release(info.scale)

    def fingerprint(self) -> str:
        """sha256 over config.json, the index, and each shard's size and header hash."""
        return self._fingerprint

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> "OfficialSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"OfficialSource({str(self.path)!r}, {len(self._infos)} tensors, {len(self._files)} shard(s))"


def _safe_shard_name(name, index_path: Path) -> str:
    if (not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..")
            or "\x00" in name):
        raise CorruptDataError(f"shard name {name!r} is not a plain file name", where=str(index_path))
    return name


def open_source(path: "str | os.PathLike") -> OfficialSource:
    """Open and validate an official DeepSeek-V4 checkpoint folder (see module doc)."""
    root = Path(path)
    if not root.exists():
        raise BadInputError("no such folder", where=str(root))
    if not root.is_dir():
        raise BadInputError("expected a checkpoint folder (config.json + safetensors)", where=str(root))
    cfg_raw, cfg_obj = _read_json(root / CONFIG, CONFIG)
    config = parse_config(cfg_obj, where=str(root / CONFIG))

    index_path = root / INDEX
    index_raw = None
    files: dict[str, SafetensorsFile] = {}
    where: dict[str, str] = {}
    if index_path.exists():
        index_raw, index = _read_json(index_path, INDEX)
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise CorruptDataError("index has no weight_map object", where=str(index_path))
        for tname, shard in wm.items():
            shard = _safe_shard_name(shard, index_path)
            if shard not in files:
                sp = root / shard
                if not sp.is_file():
                    raise CorruptDataError(f"shard {shard!r} (holding {tname!r}) does not exist",
                                           where=str(index_path), hint="the checkpoint download is incomplete")
                files[shard] = SafetensorsFile(sp)
            if tname not in files[shard]:
                raise CorruptDataError(f"index lists tensor {tname!r} in {shard!r}, which does not hold it",
                                       where=str(index_path))
            where[tname] = shard
        for shard, f in files.items():
            for tname in f.names():
                if where.get(tname) != shard:
                    other = where.get(tname)
                    said = f"lists it in {other!r}" if other else "does not list it"
                    raise CorruptDataError(f"shard {shard!r} holds tensor {tname!r} but the index {said}",
                                           where=str(index_path))
    elif (root / SINGLE).is_file():
        f = SafetensorsFile(root / SINGLE)
        files[SINGLE] = f
        where = {n: SINGLE for n in f.names()}
    else:
        raise BadInputError(f"has neither {INDEX} nor {SINGLE}", where=str(root),
                            hint="expected a DeepSeek-V4 checkpoint folder")

    doc = {
        "version": FINGERPRINT_VERSION,
        "config_sha256": hashlib.sha256(cfg_raw).hexdigest(),
        "index_sha256": hashlib.sha256(index_raw).hexdigest() if index_raw is not None else None,
        "shards": [{"file": s, "size": files[s].file_size, "header_sha256": files[s].header_sha256}
                   for s in sorted(files)],
    }
    fp = hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return OfficialSource(root, config, files, where, fp)
