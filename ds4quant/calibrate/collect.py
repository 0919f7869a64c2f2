"""Per-layer calibration sums: what the hooks on one live decoder layer record.

For every sequence run through layer L, with forward pre-hooks on the layer's
dense projections and on its routed experts (the layer as the streamed
forward materializes it; ``ds4quant.runtime.stream``):

- routed experts, called as ``experts(hidden[T,H], top_k_index[T,k],
  top_k_weights[T,k])``: per expert the sum over its routed rows of x^2 per
  input column (gate and up read ``hidden``; down reads
  ``silu(clamp(gate, max=limit)) * clamp(up, -limit, limit)`` of that expert,
  recomputed with the eager forward's ops, rows and order), the row count, and
  the slots (top_k_index itself, so hash-routed layers count like scored ones);
- dense projections (attention, compressor, indexer, shared experts; the
  output head in ``HeadSums``): the same sums of their inputs, under their
  GGUF names.

Squares of float32 values are exact in float64; each sequence's sums are
taken alone and then added to the layer's totals in sequence order, so the
totals do not depend on how the work is cut into layers, sessions (a resumed
run) or devices' transfers. ``LayerSums`` saves to and loads from one ``.npz``
(the resume journal's per-layer piece).
"""

from __future__ import annotations

import functools
import io
from typing import Optional

import numpy as np

from ds4quant.names import stack_name

__all__ = ["DENSE_MODULES", "HEAD_MODULE", "HeadSums", "LayerSums", "Totals", "statistics_bytes", "sum_sq"]

# transformers module (inside a decoder layer) -> GGUF tensor stem (blk.L.<stem>.weight);
# names from docs/reference-model.md#names (official <-> transformers) and docs/formats.md#ds4-gguf.
DENSE_MODULES = (
    ("self_attn.q_a_proj", "attn_q_a"),
    ("self_attn.q_b_proj", "attn_q_b"),
    ("self_attn.kv_proj", "attn_kv"),
    ("self_attn.o_a_proj", "attn_output_a"),  # grouped: each (token, group) row is one input row
    ("self_attn.o_b_proj", "attn_output_b"),
    ("self_attn.compressor.kv_proj", "attn_compressor_kv"),
    ("self_attn.compressor.gate_proj", "attn_compressor_gate"),
    ("self_attn.compressor.indexer.q_b_proj", "indexer.attn_q_b"),
    ("self_attn.compressor.indexer.kv_proj", "indexer_compressor_kv"),
    ("self_attn.compressor.indexer.gate_proj", "indexer_compressor_gate"),
    ("self_attn.compressor.indexer.scorer.weights_proj", "indexer.proj"),
    ("mlp.shared_experts.gate_proj", "ffn_gate_shexp"),
    ("mlp.shared_experts.up_proj", "ffn_up_shexp"),
    ("mlp.shared_experts.down_proj", "ffn_down_shexp"),
)
HEAD_MODULE = ("lm_head", "output.weight")


def sum_sq(x) -> np.ndarray:
    """float64 (cols,): sum over rows of x^2 (x: float32 torch [rows, cols], any device).
    Squares of float32 are exact in float64; numpy adds rows in order. On a GPU the
    same sums in the same order run there (``formats.search.column_square_sums_on_device``)
    and only the totals cross the link, not the rows."""
    return _host(_col_sums(x))


def _col_sums(x):
    """``sum_sq(x)``, left on a GPU as a float64 tensor (``_host`` brings it over)."""
    if x.device.type != "cpu" and _device_sums():
        from ds4quant.formats.search import column_square_sums_on_device

        return column_square_sums_on_device(x)
    a = x.detach().cpu().numpy().astype(np.float64)
    return np.square(a).sum(axis=0)


def _host(s) -> np.ndarray:
    return s if isinstance(s, np.ndarray) else s.cpu().numpy()


@functools.cache
def _device_sums() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:  # a GPU host without Triton: the rows come to the host
        return False
    return True


class _DenseHooks:
    """Pre-hooks adding each call's input rows to a per-sequence dict."""

    def __init__(self):
        self.seq: Optional[dict] = None
        self.handles: list = []
        self.names: list[str] = []

    def add(self, mod, name: str) -> None:
        def hook(_mod, args):
            if self.seq is None:
                return
            x = args[0]
            rows = x.detach().reshape(-1, x.shape[-1])
            slot = self.seq.setdefault(name, [0, np.zeros(rows.shape[1], dtype=np.float64)])
            slot[0] += int(rows.shape[0])
            slot[1] += sum_sq(rows)

        self.handles.append(mod.register_forward_pre_hook(hook))
        self.names.append(name)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _fold_dense(into: dict, seq: dict) -> None:
    for name, (rows, s) in sorted(seq.items()):
        slot = into.setdefault(name, [0, np.zeros_like(s)])
        slot[0] += rows
        slot[1] += s


def statistics_bytes(config) -> int:
    """Host bytes calibrate's sums hold at most (a transformers DeepSeek-V4 config):
    every layer's float64 sums of each routed expert's inputs and down-projection
    inputs, twice while ``Totals`` stacks them for the files, plus the dense
    projections' input sums (bounded by 1 MiB a layer)."""
    layers, n_exp = int(config.num_hidden_layers), int(config.n_routed_experts)
    h, inter = int(config.hidden_size), int(config.moe_intermediate_size)
    return 2 * layers * (n_exp * (h + inter) * 8 + 2 * n_exp * 8) + layers * (1 << 20)


class LayerSums:
    """One layer's totals over every sequence (float64 sums, int64 counts)."""

    def __init__(self, layer: int, n_expert: int, hidden: int, inter: int):
        self.layer = layer
        self.slots = np.zeros(n_expert, dtype=np.int64)
        self.rows = np.zeros(n_expert, dtype=np.int64)
        self.hidden = np.zeros((n_expert, hidden), dtype=np.float64)
        self.act = np.zeros((n_expert, inter), dtype=np.float64)
        self.dense: dict[str, list] = {}
        self._hooks = _DenseHooks()
        self._experts: Optional[dict] = None

    # -- recording on a live layer -------------------------------------------------
    def attach(self, module) -> None:
        """Pre-hooks on the layer's dense projections (a module a layer type lacks is skipped)."""
        for path, stem in DENSE_MODULES:
            try:
                mod = module.get_submodule(path)
            except AttributeError:
                continue  # e.g. no compressor in sliding-only layers
            self._hooks.add(mod, f"blk.{self.layer}.{stem}.weight")

    def begin(self) -> None:
        self._hooks.seq = {}
        self._experts = {}

    def on_experts(self, experts, hidden, idx) -> None:
        """The routed experts' call of the current sequence (from a pre-hook)."""
        import torch

        from ds4quant.calibrate.experts import expert_rows

        n_exp = experts.num_experts
        with torch.no_grad():
            flat = idx.reshape(-1)
            # The eager forward skips index n_expert (an expert-parallel
            # placeholder); anything else out of range would have failed there.
            self.slots += torch.bincount(flat[flat < n_exp], minlength=n_exp).cpu().numpy()
            if hasattr(experts, "tap"):
                # the streamed experts hand over each expert's rows and down input as the call
                # computes them (the same ops, rows and order as recomputing them here)
                experts.tap = self._tap
                return
            idx_t = idx.transpose(0, 1)  # [k, T]: the eager forward's mask[e] layout
            for e in torch.unique(flat).tolist():
                if e >= n_exp:
                    continue
                _pos, tok, x, act = expert_rows(experts, hidden, idx_t, e)
                self._tap(e, tok, x, act)

    def _tap(self, e: int, tok, x, act) -> None:
        # on a GPU the sums stay there until the sequence ends: no synchronization per expert
        self._experts[e] = (int(tok.shape[0]), _col_sums(x), _col_sums(act))

    def end(self) -> None:
        """Add the current sequence's sums to the totals."""
        for e, (rows, sh, sa) in sorted(self._experts.items()):
            self.rows[e] += rows
            self.hidden[e] += _host(sh)
            self.act[e] += _host(sa)
        _fold_dense(self.dense, self._hooks.seq)
        self._hooks.seq = None
        self._experts = None

    def detach(self) -> None:
        self._hooks.close()

    # -- the journal piece -----------------------------------------------------------
    def to_bytes(self) -> bytes:
        names = sorted(self.dense)
        buf = io.BytesIO()
        arrays = {"slots": self.slots, "rows": self.rows, "hidden": self.hidden, "act": self.act,
                  "dense_names": np.array(names, dtype=str),
                  "dense_rows": np.array([self.dense[n][0] for n in names], dtype=np.int64)}
        for i, n in enumerate(names):
            arrays[f"dense_{i}"] = self.dense[n][1]
        np.savez(buf, **arrays)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, layer: int, data: bytes) -> "LayerSums":
        z = np.load(io.BytesIO(data), allow_pickle=False)
        n_expert, hidden = z["hidden"].shape
        out = cls(layer, n_expert, hidden, z["act"].shape[1])
        out.slots, out.rows, out.hidden, out.act = z["slots"], z["rows"], z["hidden"], z["act"]
        for i, (n, r) in enumerate(zip(z["dense_names"].tolist(), z["dense_rows"].tolist())):
            out.dense[str(n)] = [int(r), z[f"dense_{i}"]]
        return out


class HeadSums:
    """The output head's input sums (``output.weight``), per sequence then in order."""

    def __init__(self):
        self.dense: dict[str, list] = {}
        self._hooks = _DenseHooks()

    def attach(self, head) -> None:
        self._hooks.add(getattr(head, HEAD_MODULE[0]), HEAD_MODULE[1])

    def begin(self) -> None:
        self._hooks.seq = {}

    def end(self) -> None:
        _fold_dense(self.dense, self._hooks.seq)
        self._hooks.seq = None

    def detach(self) -> None:
        self._hooks.close()


class Totals:
    """Every layer's sums and the head's, gathered for the files."""

    def __init__(self, layers: list[LayerSums], head: HeadSums, tokens: int):
        self.tokens = tokens
        self.slots = np.stack([s.slots for s in layers])
        self.rows = np.stack([s.rows for s in layers])
        self.hidden = np.stack([s.hidden for s in layers])
        self.act = np.stack([s.act for s in layers])
        every: dict[str, list] = {}
        for s in layers:
            every.update(s.dense)
        every.update(head.dense)
        # the order a whole-model run meets them in: its first sequence's names, sorted
        self.dense = {name: every[name] for name in sorted(every)}

    def imatrix(self, seq_lens, dataset: str):
        """The GGUF imatrix of these sums (``ds4quant.calib.imatrix.make_imatrix``)."""
        from ds4quant.calib.imatrix import make_imatrix

        sums: dict = {}
        for layer in range(self.hidden.shape[0]):
            hid = self.hidden[layer].astype(np.float32)
            counts = self.rows[layer].astype(np.float64)
            sums[stack_name(layer, "gate")] = (hid, counts)
            sums[stack_name(layer, "up")] = (hid, counts)
            sums[stack_name(layer, "down")] = (self.act[layer].astype(np.float32), counts)
        for name, (rows, s) in self.dense.items():
            sums[name] = (s.astype(np.float32), [rows])
        lens = set(seq_lens)
        return make_imatrix(sums, datasets=(dataset,), chunk_count=len(seq_lens),
                            chunk_size=next(iter(lens)) if len(lens) == 1 else None)
