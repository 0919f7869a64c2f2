"""The one reader of an artifact: ``open_artifact(path) -> ArtifactView``.

An artifact is a folder (GGUF set + ``manifest.json``; a release adds
``SHA256SUMS``), or a bare ``.gguf`` (any file of a split set). The view
opens it in a fixed order, each step raising the validating readers'
``Ds4quantError`` when its input is unusable (truncated, malformed):

1. layout (``locate``): which GGUF set, manifest and sums belong together;
2. ``SHA256SUMS`` (releases), then ``manifest.json`` (folders);
3. the GGUF split set (``read_gguf_set``: spans, tags, split keys);
4. routed-expert stacks: full ``blk.L.ffn_P_exps.weight`` (experts 0..E-1)
   and compact ``blk.L.ffn_P_exps.<qtype>.weight`` with their global ids in
   ``ds4quant.expert_ids.<name>``, covering every expert of every layer once;
5. codebook tables: the own table (KV ``ds4quant.codebooks``) and the
   Lucebox blobs (``deepseek4.{p4mix,gumix,dmix}.sidecar`` embedded, or loose
   ``NAME.gguf.<kind>.bin``), valid, covering every resident MIX tensor once
   and agreeing with each other;
6. the runtimes that can load it, decided from its whole header and tensor
   list (``runtimes.decide``), against the stored ``ds4quant.runtimes`` key
   (a key that claims a runtime the decision does not allow is a problem).

Steps 4-6 never raise on content: what is wrong is a ``Problem`` (check name,
detail, file, tensor) in ``problems()``, and the caller decides whether a
problem is a failed check (verify) or an error (the runtime loader).
Invalid stacks are left out of ``stacks``; tensors without valid books have
no ``book_entry``.

    with open_artifact("out/tiny-strix") as v:
        st = v.stacks_for(3, "down")[0]
        rows = v.expert_data(st.name, ids=[4, 5])   # uint8 (2, rows, row_bytes), memmap-backed
        v.runtimes, v.problems()
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ds4quant import names
from ds4quant.artifact.layout import Layout, locate
from ds4quant.errors import BadInputError, CodebookError, Ds4quantError
from ds4quant.names import Proj

MANIFEST = names.MANIFEST_NAME
SUMS = names.SUMS_NAME


# ----------------------------------------------------------------------------
# records


@dataclass(frozen=True)
class Problem:
    """One thing wrong inside a readable artifact; ``check`` is verify's check name."""

    check: str
    detail: str
    file: Optional[str] = None
    tensor: Optional[str] = None


@dataclass(frozen=True)
class Ds4Header:
    """The ``deepseek4.*`` model keys (None where the GGUF lacks the key or it is mistyped)."""

    n_layer: Optional[int]
    n_expert: Optional[int]
    n_expert_used: Optional[int]
    hidden: Optional[int]
    expert_ffn: Optional[int]
    vocab: Optional[int]
    hash_layers: Optional[int]
    swiglu_limit: Optional[float]
    routed_scale: Optional[float]


@dataclass(frozen=True)
class StackInfo:
    """One routed-expert stack tensor (GGUF shape [cols, rows, n])."""

    name: str
    layer: int
    proj: Proj
    qtype: str
    rows: int  # ne[1]: output features of one expert
    cols: int  # ne[0]: input features
    expert_ids: tuple[int, ...]  # global ids in local order
    compact: bool
    expert_nbytes: int  # bytes of one expert

    @property
    def n_experts(self) -> int:
        return len(self.expert_ids)


def _with_note(e: Ds4quantError, note: str) -> Ds4quantError:
    return e if not note else type(e)(e.message + note, where=e.where, hint=e.hint)


def _damage_note(lay: Layout, path: Path, manifest, sums: Optional[Mapping[str, str]]) -> str:
    """When a file cannot be parsed: say whether its recorded hash also differs."""
    from ds4quant.artifact.manifest import sha256_file

    rel = lay.rel(path)
    want = []
    if manifest is not None:
        want += [(MANIFEST, f.sha256) for f in manifest.files if f.name == rel]
    if sums is not None and rel in sums:
        want.append((SUMS, sums[rel]))
    if not want or not path.is_file():
        return ""
    have = sha256_file(path)
    bad = [w for w, sha in want if sha != have]
    return f" (its sha256 also differs from {' and '.join(bad)}: the file is damaged)" if bad else ""


def _ids_text(ids) -> str:
    ids = [int(i) for i in ids]
    return ", ".join(map(str, ids[:8])) + (", ..." if len(ids) > 8 else "")


def open_artifact(path: "str | os.PathLike", variant_107: Optional[str] = None) -> "ArtifactView":
    """Open and validate an artifact folder, release folder, or ``.gguf``.

    variant_107: the codec of untagged ggml type 107 tensors (foreign files).
    Raises Ds4quantError when a container cannot be parsed (the message says
    when the file's recorded sha256 differs too); content problems are in
    ``problems()``.
    """
    return ArtifactView(locate(path), variant_107)


# ----------------------------------------------------------------------------
# the view


class ArtifactView:
    """A validated artifact (see the module docstring). Use ``open_artifact``."""

    def __init__(self, layout: Layout, variant_107: Optional[str] = None) -> None:
        from ds4quant.artifact.gguf_reader import read_gguf_set
        from ds4quant.artifact.manifest import read_manifest
        from ds4quant.artifact.tags import check_variant_107

        check_variant_107(variant_107)
        self.layout = layout
        self.folder = layout.folder
        self.kind = layout.kind
        self._problems: list[Problem] = []
        sums = None
        if layout.sums is not None:
            from ds4quant.artifact.sums import read_sums

            sums = dict(read_sums(layout.sums))
        self.sums: Optional[Mapping[str, str]] = None if sums is None else MappingProxyType(sums)
        self.manifest = None
        self.manifest_bytes: Optional[bytes] = None
        if layout.manifest is not None:
            try:
                self.manifest = read_manifest(layout.manifest)
            except Ds4quantError as e:
                raise _with_note(e, _damage_note(layout, layout.manifest, None, sums)) from None
            self.manifest_bytes = layout.manifest.read_bytes()
        try:
            self.gguf = read_gguf_set(layout.gguf, variant_107=variant_107)
        except Ds4quantError as e:
            bad = Path(e.where) if e.where and Path(e.where).is_file() else layout.gguf
            raise _with_note(e, _damage_note(layout, bad, self.manifest, sums)) from None
        self.gguf_paths: tuple[Path, ...] = tuple(self.gguf.files)
        self.kv = self.gguf.kv
        self.sidecars: tuple[Path, ...] = tuple(
            p for f in self.gguf_paths for kind in names.LUCEBOX_KINDS
            if (p := f.with_name(f.name + names.sidecar_suffix(kind))).is_file())
        self.header = Ds4Header(
            self._kv_int(names.KEY_BLOCK_COUNT), self._kv_int(names.KEY_EXPERT_COUNT),
            self._kv_int(names.KEY_EXPERT_USED_COUNT), self._kv_int(names.KEY_EMBEDDING_LENGTH),
            self._kv_int(names.KEY_EXPERT_FFN_LENGTH), self._kv_int(names.KEY_VOCAB_SIZE),
            self._kv_int(names.KEY_HASH_LAYER_COUNT), self._kv_clamp(),
            self._kv_float(names.KEY_EXPERT_WEIGHTS_SCALE))
        self._stacks = self._read_stacks()
        self.stacks: tuple[StackInfo, ...] = tuple(self._stacks.values())
        self._books, self.codebook_tables, self.lucebox_books, self.lucebox_loose_books = self._read_codebooks()
        self.mix_tensors: tuple[str, ...] = tuple(n for n, i in self.gguf.tensors.items() if i.needs_codebooks)
        self.runtime_decision = self._runtimes()
        self.runtimes: tuple[str, ...] = self.runtime_decision.runtimes
        # engine -> why it cannot load the artifact (inspect and the model card print it)
        self.runtimes_excluded: Mapping[str, tuple[str, ...]] = self.runtime_decision.excluded
        self.stored_runtimes = self._stored_runtimes()
        if self.stored_runtimes is not None:
            for why in self.runtime_decision.claim_problems(self.stored_runtimes):
                self._problem("runtimes", f"{names.KEY_RUNTIMES} claims more than the contents allow: {why}",
                              self.rel(self.gguf.path))

    # -- plain accessors ------------------------------------------------------

    def __enter__(self) -> "ArtifactView":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Nothing is held open between calls (each memmap maps on demand); kept for ``with``."""

    def rel(self, path: "str | os.PathLike") -> str:
        return self.layout.rel(path)

    @property
    def first_file(self) -> str:
        """The first GGUF's name relative to the folder (where header problems are reported)."""
        return self.rel(self.gguf.path)

    def problems(self) -> list[Problem]:
        """Every problem steps 4-6 found, in the order found."""
        return list(self._problems)

    def tensor(self, name: str):
        """The ``TensorInfo`` of ``name`` (BadInputError if absent)."""
        return self.gguf.tensor(name)

    @property
    def tensors(self) -> Mapping[str, Any]:
        return self.gguf.tensors

    def tensor_data(self, name: str) -> np.ndarray:
        """The payload of ``name`` as a read-only uint8 memmap (nbytes,)."""
        return self.gguf.tensor_data(name)

    def _problem(self, check: str, detail: str, file: Optional[str] = None, tensor: Optional[str] = None) -> None:
        self._problems.append(Problem(check, detail, file, tensor))

    def _kv_int(self, key: str) -> Optional[int]:
        kv = self.kv.get(key)
        if kv is None or isinstance(kv.value, (np.ndarray, tuple, str, bytes, float, bool)):
            return None
        return int(kv.value)

    def _kv_float(self, key: str) -> Optional[float]:
        kv = self.kv.get(key)
        if kv is None or isinstance(kv.value, (np.ndarray, tuple, str, bytes, bool)):
            return None
        return float(kv.value)

    def _kv_clamp(self) -> Optional[float]:
        """The SwiGLU clamp: one number, or one per block (llama.cpp's converter's form), all equal."""
        kv = self.kv.get(names.KEY_SWIGLU_CLAMP)
        if kv is None or not isinstance(kv.value, np.ndarray):
            return self._kv_float(names.KEY_SWIGLU_CLAMP)
        vals = [float(x) for x in kv.value.reshape(-1)]
        if vals and all(v == vals[0] for v in vals):
            return vals[0]
        self._problem("ds4_keys", f"{names.KEY_SWIGLU_CLAMP} gives the blocks different clamps; DeepSeek-V4 "
                                  "clamps every layer alike", self.first_file)
        return None

    # -- stacks ---------------------------------------------------------------

    def _read_stacks(self) -> dict[str, StackInfo]:
        from gguf import GGUFValueType as VT

        first = self.first_file
        E, L = self.header.n_expert, self.header.n_layer
        pre = names.KEY_EXPERT_IDS_PREFIX
        ids_kv = {k[len(pre):]: v for k, v in self.kv.items() if k.startswith(pre)}
        stacks: dict[str, StackInfo] = {}
        for name, info in self.gguf.tensors.items():
            sn = names.parse_stack(name)
            if sn is None or len(info.shape) != 3:
                continue  # a stack of the wrong rank is the shapes check's to report
            f = Path(info.path).name
            n = info.shape[2]
            per = info.nbytes // n if n else 0
            if not sn.compact:
                if name in ids_kv:
                    self._problem("experts", f"a full stack must not carry {names.expert_ids_key(name)}", first, name)
                stacks[name] = StackInfo(name, sn.layer, sn.proj, info.qtype, info.shape[1], info.shape[0],
                                         tuple(range(n)), False, per)
                continue
            kv = ids_kv.get(name)
            if kv is None:
                self._problem("experts", f"compact stack has no {pre}<name> list of global expert ids", f, name)
                continue
            if kv.type != VT.ARRAY or kv.sub_type != VT.UINT32:
                self._problem("experts", f"{names.expert_ids_key(name)} must be an ARRAY of UINT32", first, name)
                continue
            ids = tuple(int(i) for i in kv.value)
            if len(ids) != n:
                self._problem("experts", f"{len(ids)} expert ids for a stack of {n} experts (ne[2])", f, name)
                continue
            if any(b <= a for a, b in zip(ids, ids[1:])) or (E is not None and ids and ids[-1] >= E):
                self._problem("experts", f"expert ids must be strictly increasing and below {E}", first, name)
                continue
            stacks[name] = StackInfo(name, sn.layer, sn.proj, info.qtype, info.shape[1], info.shape[0], ids, True,
                                     per)
        for name in sorted(set(ids_kv) - set(stacks)):
            if name not in self.gguf.tensors:
                self._problem("experts", f"{names.expert_ids_key(name)} names no tensor of the set", first, name)
        if E is not None:
            by_key: dict[tuple[int, Proj], list[StackInfo]] = {}
            for st in stacks.values():
                by_key.setdefault((st.layer, st.proj), []).append(st)
            layers = range(L) if L is not None and by_key else sorted({k[0] for k in by_key})
            for layer in layers:
                for proj in names.PROJS:
                    got = by_key.get((layer, proj))
                    where = f"blk.{layer}.ffn_{proj.value}_exps"
                    if not got:
                        self._problem("experts", "no stack holds this layer's experts", first, where)
                        continue
                    count = np.zeros(E, np.int64)
                    for st in got:
                        count[[i for i in st.expert_ids if i < E]] += 1
                    missing, twice = np.flatnonzero(count == 0), np.flatnonzero(count > 1)
                    if missing.size or twice.size:
                        parts = []
                        if missing.size:
                            parts.append(f"{missing.size} expert(s) in no stack ({_ids_text(missing)})")
                        if twice.size:
                            parts.append(f"{twice.size} expert(s) in several stacks ({_ids_text(twice)})")
                        self._problem("experts", "; ".join(parts) + f" of {E}", first, where)
        return stacks

    def stack(self, name: str) -> StackInfo:
        """The valid stack ``name`` (BadInputError when it is not one)."""
        st = self._stacks.get(name)
        if st is None:
            raise BadInputError("not a valid routed-expert stack of the artifact", where=f"{self.first_file}: {name}")
        return st

    def stacks_for(self, layer: int, proj: "str | Proj") -> tuple[StackInfo, ...]:
        """The stacks holding ``layer``'s ``proj`` experts (one full, or several compact)."""
        p = names.as_proj(proj)
        return tuple(s for s in self.stacks if s.layer == layer and s.proj == p)

    def _locals(self, st: StackInfo, ids: Optional[Sequence[int]]) -> list[int]:
        if ids is None:
            return list(range(st.n_experts))
        pos = {g: i for i, g in enumerate(st.expert_ids)}
        out = []
        for g in ids:
            i = pos.get(int(g)) if not isinstance(g, bool) else None
            if i is None:
                raise BadInputError(f"expert {g!r} is not in this stack (it holds {_ids_text(st.expert_ids)})",
                                    where=f"{self.first_file}: {st.name}")
            out.append(i)
        return out

    def expert_data(self, stack_name: str, ids: Optional[Sequence[int]] = None) -> np.ndarray:
        """uint8 (n, rows, row_bytes): the encoded rows of experts ``ids``
        (global ids, default all) in that order; read-only. A memmap slice when
        the ids are one contiguous increasing run of the stack, else a copy."""
        st = self.stack(stack_name)
        loc = self._locals(st, ids)
        if st.rows == 0 or st.expert_nbytes % st.rows:
            raise BadInputError(f"{st.expert_nbytes} bytes per expert do not split into {st.rows} rows",
                                where=f"{self.first_file}: {st.name}")
        row_bytes = st.expert_nbytes // st.rows
        data = self.tensor_data(st.name)[: st.n_experts * st.expert_nbytes]
        full = data.reshape(st.n_experts, st.rows, row_bytes)
        if loc and loc == list(range(loc[0], loc[0] + len(loc))):
            return full[loc[0]:loc[0] + len(loc)]
        out = full[np.asarray(loc, dtype=np.int64)] if loc else np.zeros((0, st.rows, row_bytes), np.uint8)
        out.flags.writeable = False
        return out

    def expert_weights(self, stack_name: str, expert: int) -> np.ndarray:
        """float32 [rows, cols] of global ``expert`` of ``stack_name``, decoded; a MIX stack's
        expert with its own codebooks (``book_entry``), which a bare ``formats.decode`` lacks."""
        from ds4quant.formats import QTYPES, decode

        st = self.stack(stack_name)
        (i,) = self._locals(st, [expert])
        info = self.tensor(st.name)
        qt = QTYPES.get(st.qtype)
        if qt is None or not info.decodable:
            raise BadInputError(f"ds4quant cannot decode {st.qtype}", where=f"{self.first_file}: {st.name}")
        eb: tuple = (None, None)
        if qt.is_mix:
            entry = self.book_entry(st.name)
            if entry is None:
                raise CodebookError("MIX tensor without valid codebooks", where=f"{self.first_file}: {st.name}")
            eb = (entry.books[i], int(entry.modes[i]))
        raw = np.asarray(self.expert_data(st.name, [expert])).reshape(-1)
        return decode(st.qtype, raw, info.shape[0], *eb).reshape(st.rows, info.shape[0])

    def expert_span(self, stack_name: str, expert: int) -> tuple[Path, int, int]:
        """(file, absolute offset, nbytes) of global ``expert``'s bytes in ``stack_name``."""
        st = self.stack(stack_name)
        (i,) = self._locals(st, [expert])
        info = self.tensor(st.name)
        return Path(info.path), info.offset + i * st.expert_nbytes, st.expert_nbytes

    def fingerprint(self) -> str:
        """What a placement is planned for and cluster ranks agree on: sha256 of
        the artifact's SHA256SUMS entries when it has them ('sha256:...'), else of
        its expert-stack layout ('layout:...')."""
        if self.sums:
            blob = json.dumps(sorted(self.sums.items()), separators=(",", ":")).encode()
            return "sha256:" + hashlib.sha256(blob).hexdigest()
        lay = [[s.name, s.qtype, list(s.expert_ids), int(s.expert_nbytes)] for s in self.stacks]
        return "layout:" + hashlib.sha256(json.dumps(lay, separators=(",", ":")).encode()).hexdigest()

    def expert_nbytes(self) -> np.ndarray:
        """int64 (n_layer, n_expert): gate + up + down bytes of each expert.

        n_layer / n_expert from the deepseek4 keys, else from the stacks."""
        L = self.header.n_layer
        E = self.header.n_expert
        if L is None:
            L = 1 + max((s.layer for s in self.stacks), default=-1)
        if E is None:
            E = 1 + max((max(s.expert_ids, default=-1) for s in self.stacks), default=-1)
        out = np.zeros((L, E), np.int64)
        for s in self.stacks:
            if s.layer < L:
                ids = [i for i in s.expert_ids if i < E]
                out[s.layer, ids] += s.expert_nbytes
        return out

    # -- codebooks ------------------------------------------------------------

    def _read_codebooks(self) -> tuple[dict, tuple[str, ...], bool, bool]:
        """(tensor -> CodebookEntry to decode with, tables found, Lucebox blobs
        hold valid books for every resident MIX tensor (embedded preferred, as
        the loaders that read embedded blobs do), the loose files alone do)."""
        from ds4quant.codebooks import from_lucebox, read_table
        from ds4quant.codebooks.dmix import read_dmix
        from ds4quant.codebooks.gumix import check_gumix_coverage, read_gumix
        from ds4quant.codebooks.p4mix import check_p4mix_coverage, read_p4mix
        from ds4quant.codebooks.table import check_coverage

        g, stacks, first = self.gguf, self._stacks, self.first_file
        E, L = self.header.n_expert, self.header.n_layer
        key = names.KEY_CODEBOOKS
        mix = {n: i for n, i in g.tensors.items() if i.needs_codebooks}
        resident = {n: (i.qtype, i.shape[2] if len(i.shape) == 3 else 1) for n, i in mix.items()}
        tables: list[str] = []
        books: dict = {}
        own = None
        if key in g.kv:
            tables.append(key)
            try:
                own = read_table(g.blob(key), what=f"KV {key}")
            except Ds4quantError as e:
                self._problem("codebooks", e.one_line(), first)
            else:
                try:
                    check_coverage(own, resident, what=f"KV {key}")
                except CodebookError as e:
                    self._problem("codebooks", e.one_line(), first)
                for e in own.entries:
                    st = stacks.get(e.name)
                    if st is None or resident.get(e.name) != (e.qtype, e.n_experts):
                        continue
                    n_global = E if E is not None else e.n_global
                    if e.global_ids != st.expert_ids or e.n_global != n_global:
                        self._problem("codebooks", f"table entry lists experts {_ids_text(e.global_ids)} of "
                                                   f"{e.n_global}, the stack holds {_ids_text(st.expert_ids)} of "
                                                   f"{n_global}", first, e.name)
                        continue
                    books[e.name] = e
                for e in own.entries:
                    if e.name in resident and e.name not in stacks and resident[e.name] == (e.qtype, e.n_experts):
                        books[e.name] = e  # a dense MIX tensor (one book pair)
        elif mix and g.format_version is not None:
            self._problem("codebooks", f"{len(mix)} MIX tensor(s) but no {key} table; every ds4quant artifact "
                                       "carries its own name-keyed table", first, sorted(mix)[0])

        # Lucebox blobs: embedded KV (the loader's preference) and loose files.
        blobs: dict[str, bytes] = {}
        loose_blobs: dict[str, bytes] = {}
        readers = {"p4mix": read_p4mix, "gumix": read_gumix, "dmix": read_dmix}
        for kind in names.LUCEBOX_KINDS:
            skey = names.sidecar_key(kind)
            found: list[tuple[str, bytes]] = []
            if skey in g.kv:
                try:
                    found.append((f"KV {skey}", g.blob(skey)))
                except Ds4quantError as e:
                    self._problem("codebooks", e.one_line(), first)
            for p in self.sidecars:
                if p.name.endswith(names.sidecar_suffix(kind)):
                    found.append((self.rel(p), p.read_bytes()))
            good = []
            for what, data in found:
                tables.append(what)
                try:
                    readers[kind](data, n_layers=L, what=what)
                except Ds4quantError as e:
                    self._problem("codebooks", e.one_line(), what if not what.startswith("KV ") else first)
                    continue
                good.append((what, data))
            for what, data in good[1:]:
                if data != good[0][1]:
                    self._problem("codebooks", f"differs from {good[0][0]} (the loader would read the embedded copy)",
                                  what if not what.startswith("KV ") else first)
            if good:
                blobs[kind] = good[0][1]
            loose_good = [d for what, d in good if not what.startswith("KV ")]
            if loose_good:
                loose_blobs[kind] = loose_good[0]
        full = {n: mix[n] for n, st in stacks.items() if n in mix and not st.compact}
        surface = {Proj.GATE: 0, Proj.UP: 1, Proj.DOWN: 2}

        def lucebox_table(bl: dict):
            if "p4mix" in bl:
                check_p4mix_coverage(read_p4mix(bl["p4mix"]), {
                    stacks[n].layer: (i.shape[2], i.shape[1], i.shape[0])
                    for n, i in full.items() if i.ggml_type == 105 and stacks[n].proj == Proj.DOWN})
            if "gumix" in bl:
                check_gumix_coverage(read_gumix(bl["gumix"]), {
                    (stacks[n].layer, surface[stacks[n].proj]): (i.shape[2], i.shape[1], i.shape[0])
                    for n, i in full.items() if i.ggml_type == 106})
            return from_lucebox(bl.get("p4mix"), bl.get("gumix"), bl.get("dmix")).table

        lucebox = loose = False
        if loose_blobs and mix:
            try:
                loose = set(mix) <= set(lucebox_table(loose_blobs).names)
            except Ds4quantError:
                loose = False  # the problem is reported below when these are the blobs a loader reads
        if blobs:
            try:
                lb = lucebox_table(blobs)
            except Ds4quantError as e:
                self._problem("codebooks", e.one_line(), first)
            else:
                lucebox = bool(mix) and set(mix) <= set(lb.names)
                for e in lb.entries:
                    if e.name not in resident:
                        self._problem("codebooks", "Lucebox blob has an entry for a tensor that is not a resident MIX "
                                                   "tensor", first, e.name)
                    elif own is not None and e.name in own:
                        if own[e.name] != e:
                            self._problem("codebooks", f"Lucebox blob books/modes differ from {key}", first, e.name)
                    elif own is not None:
                        self._problem("codebooks", f"in a Lucebox blob but not in {key}", first, e.name)
                    if e.name not in books and e.name in resident and resident[e.name] == (e.qtype, e.n_experts):
                        books[e.name] = e  # foreign (Lucebox) files: decode with the blob's books
        return books, tuple(tables), lucebox, lucebox and loose

    def book_entry(self, tensor: str):
        """The ``codebooks.CodebookEntry`` to decode ``tensor`` with (own table,
        else Lucebox blobs), or None (not MIX, or no valid books)."""
        return self._books.get(tensor)

    # -- runtimes -------------------------------------------------------------

    def _runtimes(self):
        from ds4quant.artifact.runtimes import LuceboxBooks, Tensor, decide

        tensors = {n: Tensor(i.qtype, tuple(i.shape), (s := names.parse_stack(n)) is not None and s.compact)
                   for n, i in self.gguf.tensors.items()}
        return decide(self.kv, tensors, LuceboxBooks(self.lucebox_books, self.lucebox_loose_books))

    def _stored_runtimes(self) -> Optional[tuple[str, ...]]:
        kv = self.kv.get(names.KEY_RUNTIMES)
        if kv is None:
            return None
        v = kv.value
        if isinstance(v, str):
            self._problem("runtimes", f"{names.KEY_RUNTIMES} must be an ARRAY of STRING", self.first_file)
            return (v,)
        try:
            return tuple(str(x) for x in v)
        except TypeError:
            self._problem("runtimes", f"{names.KEY_RUNTIMES} must be an ARRAY of STRING", self.first_file)
            return (str(v),)

    # -- dense tensors --------------------------------------------------------

    def dense(self, name: str) -> np.ndarray:
        """A non-expert tensor decoded to float32 in its logical shape (GGUF shape
        reversed); i32 tensors come back as int32. MIX tensors use ``book_entry``."""
        from ds4quant.formats import QTYPES, decode

        if names.parse_stack(name) is not None:
            raise BadInputError("is a routed-expert stack; read it with expert_data()",
                                where=f"{self.first_file}: {name}")
        info = self.tensor(name)
        shape = tuple(reversed(info.shape))
        data = np.asarray(self.tensor_data(name))
        if info.qtype == "i32":
            return data.view("<i4").reshape(shape).astype(np.int32)
        qt = QTYPES.get(info.qtype)
        if qt is None or not info.decodable:
            raise BadInputError(f"ds4quant cannot decode {info.qtype}", where=f"{self.first_file}: {name}")
        eb: tuple = (None, None)
        if qt.is_mix:
            entry = self.book_entry(name)
            if entry is None:
                raise CodebookError("MIX tensor without valid codebooks", where=f"{self.first_file}: {name}")
            eb = (entry.books[0], int(entry.modes[0]))
        return decode(info.qtype, data, info.shape[0], *eb).reshape(shape)
