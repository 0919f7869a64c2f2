"""Stand-in for H1's ``ds4quant.artifact.view`` until it is merged (delete then).

Only the part of the PLAN.md view API the runtime calls: header, stacks,
expert_data, book_entry, dense, tensor, tensor_data, close. Built on the
validating reader; no checks of its own beyond what the loader needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ds4quant import names
from ds4quant.errors import BadInputError


@dataclass(frozen=True)
class Header:
    n_layer: int
    n_expert: int
    n_expert_used: int
    hidden: int
    expert_ffn: int
    vocab: int
    hash_layers: int
    swiglu_limit: float
    routed_scale: float


@dataclass(frozen=True)
class StackInfo:
    name: str
    layer: int
    proj: names.Proj
    qtype: str
    rows: int
    cols: int
    expert_ids: tuple
    compact: bool
    expert_nbytes: int


class FallbackView:
    def __init__(self, path):
        from ds4quant.artifact import read_gguf_set

        p = Path(path)
        if p.is_dir():
            ggufs = sorted(q for q in p.iterdir() if q.suffix == ".gguf")
            if not ggufs:
                raise BadInputError("no .gguf file in the folder", where=str(p))
            p = ggufs[0]
        self.folder = p.parent
        self._g = read_gguf_set(p)
        self.kv = self._g.kv
        v = lambda k, d=None: self._g.kv_value(k, d)  # noqa: E731
        self.header = Header(int(v(names.KEY_BLOCK_COUNT)), int(v(names.KEY_EXPERT_COUNT)),
                             int(v(names.KEY_EXPERT_USED_COUNT)), int(v(names.KEY_EMBEDDING_LENGTH)),
                             int(v(names.KEY_EXPERT_FFN_LENGTH)), int(v(names.KEY_VOCAB_SIZE)),
                             int(v(names.KEY_HASH_LAYER_COUNT, 0)), float(v(names.KEY_SWIGLU_CLAMP, 10.0)),
                             float(v(names.KEY_EXPERT_WEIGHTS_SCALE, 1.0)))
        stacks = []
        for name, t in self._g.tensors.items():
            s = names.parse_stack(name)
            if s is None:
                continue
            cols, rows, n = t.shape
            key = names.expert_ids_key(name)
            ids = tuple(int(i) for i in v(key)) if s.compact else tuple(range(n))
            stacks.append(StackInfo(name, s.layer, s.proj, t.qtype, rows, cols, ids, s.compact, t.nbytes // n))
        self.stacks = tuple(stacks)
        self._table = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        pass

    def stacks_for(self, layer, proj):
        p = names.as_proj(proj)
        return tuple(s for s in self.stacks if s.layer == layer and s.proj == p)

    def tensor(self, name):
        return self._g.tensor(name)

    def tensor_data(self, name):
        return self._g.tensor_data(name)

    def expert_data(self, stack_name, ids=None):
        s = next(s for s in self.stacks if s.name == stack_name)
        data = np.asarray(self._g.tensor_data(stack_name)).reshape(len(s.expert_ids), s.rows, -1)
        if ids is None:
            return data
        pos = {g: i for i, g in enumerate(s.expert_ids)}
        local = [pos[int(i)] for i in ids]
        if local and local == list(range(local[0], local[0] + len(local))):
            return data[local[0]:local[0] + len(local)]
        return data[local]

    def book_entry(self, tensor) -> Optional[object]:
        from ds4quant.codebooks import from_lucebox, read_table

        if self._table is None:
            if names.KEY_CODEBOOKS in self.kv:
                self._table = read_table(np.asarray(self.kv[names.KEY_CODEBOOKS].value, dtype=np.uint8).tobytes())
            else:
                blobs = {k: (np.asarray(self.kv[names.sidecar_key(k)].value, dtype=np.uint8).tobytes()
                             if names.sidecar_key(k) in self.kv else None) for k in names.LUCEBOX_KINDS}
                self._table = from_lucebox(blobs["p4mix"], blobs["gumix"], blobs["dmix"]).table
        return self._table[tensor] if tensor in self._table else None

    def dense(self, name):
        from ds4quant import formats

        t = self._g.tensor(name)
        cols = t.shape[0]
        out = formats.decode(t.qtype, np.asarray(self._g.tensor_data(name)), cols)
        return out.reshape(tuple(reversed(t.shape)))


def open_fallback(path):
    return FallbackView(path)
