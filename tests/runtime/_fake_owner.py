"""A test-only owner: float64 reference math over float32 ("f32") stacks.

It lets the worker tests run without the numba CPU owner, and it can sleep,
raise or print on request so the tests can kill a worker mid-call, see a
remote exception, and check that stray prints never corrupt the protocol.
"""

from __future__ import annotations

import time

import numpy as np

from ds4quant.runtime.owners.base import ExpertStack

LIMIT = 10.0


class FakeOwner:
    def __init__(self, identity: str = "fake:0", sleep_s: float = 0.0, fail_layer: int | None = None,
                 noisy: bool = False):
        self.identity = identity
        self.sleep_s = sleep_s
        self.fail_layer = fail_layer
        self.noisy = noisy
        self.stacks: dict[tuple[int, str], ExpertStack] = {}
        self.books: dict[str, tuple] = {}

    def add_stack(self, stack: ExpertStack) -> None:
        if stack.qtype != "f32":
            raise ValueError(f"fake owner holds only f32 stacks, got {stack.qtype} for {stack.tensor}")
        self.stacks[(stack.layer, stack.proj)] = stack

    def register_books(self, tensor, expert_ids, entry) -> None:
        ids = tuple(int(e) for e in expert_ids)
        if entry.expert_ids is not None and ids != tuple(entry.expert_ids):
            raise ValueError(f"{tensor}: ids {ids} != the entry's {entry.expert_ids}")
        self.books[tensor] = (ids, entry)

    def experts(self, layer):
        sets = [set(self.stacks[(layer, p)].expert_ids) for p in ("gate", "up", "down") if (layer, p) in self.stacks]
        return tuple(sorted(set.intersection(*sets))) if len(sets) == 3 else ()

    def _weights(self, layer, proj, expert):
        s = self.stacks[(layer, proj)]
        local = s.expert_ids.index(int(expert))
        return s.data[local].view(np.float32).reshape(s.rows, s.cols).astype(np.float64)

    def run_slots(self, layer, x, expert_ids, mode):
        if self.noisy:
            print("fake owner: a stray line on stdout", flush=True)
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if layer == self.fail_layer:
            raise ValueError(f"fake failure on layer {layer}")
        out = np.empty(x.shape, np.float32)
        for i, e in enumerate(expert_ids):
            xi = x[i].astype(np.float64)
            # Elementwise products + numpy's pairwise sum: no BLAS, same order every call.
            g = (self._weights(layer, "gate", e) * xi).sum(axis=1)
            u = (self._weights(layer, "up", e) * xi).sum(axis=1)
            gc = np.minimum(g, LIMIT)
            h = gc / (1.0 + np.exp(-gc)) * np.clip(u, -LIMIT, LIMIT)
            out[i] = (self._weights(layer, "down", e) * h).sum(axis=1).astype(np.float32)
        return out

    def resident_bytes(self) -> int:
        books = sum(e.books.nbytes + e.modes.nbytes for _, e in self.books.values())
        return sum(s.nbytes for s in self.stacks.values()) + books

    def close(self) -> None:
        self.books.clear()
        self.stacks.clear()


def make_layer(layer: int, expert_ids, hidden: int, ffn: int, seed: int = 0) -> list[ExpertStack]:
    """Seeded f32 gate/up/down stacks of one layer for ``expert_ids``."""
    rng = np.random.default_rng([seed, layer])
    ids = tuple(int(e) for e in expert_ids)
    stacks = []
    for proj, rows, cols in (("gate", ffn, hidden), ("up", ffn, hidden), ("down", hidden, ffn)):
        w = (rng.standard_normal((len(ids), rows, cols)) / np.sqrt(cols)).astype(np.float32)
        stacks.append(ExpertStack(
            tensor=f"blk.{layer}.ffn_{proj}_exps.weight", layer=layer, proj=proj, qtype="f32",
            rows=rows, cols=cols, expert_ids=ids, data=w.view(np.uint8).reshape(len(ids), rows, cols * 4),
        ))
    return stacks


class EchoOwner(FakeOwner):
    """Returns x unchanged: isolates the worker's transport cost when measured."""

    def run_slots(self, layer, x, expert_ids, mode):
        return np.array(x, np.float32)
