"""The layer walk: every calibration sequence through the streamed model, one
decoder layer at a time, with the sums, the sensitivity branches and the
journal that lets a killed run resume.

Per layer L (materialized once): each sequence's hidden streams are read
from the work folder, run through the layer with the hooks of
``collect.LayerSums`` recording (in sequence order, in ``batch_groups`` of up
to ``batch`` sequences of one length; the sensitivity sequences among
themselves), and written as layer L+1's input. Then the sensitivity pass (if
any) measures the layer on the captured experts calls of its sequences, the
branches alive at L go through the unperturbed layer and the branches that
start at L through the perturbed one, in the same batches. The layer's sums
and sensitivity piece are saved, the journal records the layer finished, its
input states are dropped. After the last
layer the head runs: the ``output.weight`` sums, the reference
log-probabilities of the sensitivity sequences and each branch's KL.

Memory: one materialized layer, one batch's hidden streams and the
sensitivity sequences' captured experts calls; every hidden state lives in
the work folder (``journal``), one file per sequence whatever the batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ds4quant.calibrate.collect import HeadSums, LayerSums
from ds4quant.calibrate.journal import Journal
from ds4quant.calibrate.sensitivity import SensitivityPass, kl_sum, ref_logp
from ds4quant.progress import Meter, ProgressFn

__all__ = ["WalkResult", "batch_groups", "walk"]

MAIN = "main"


def batch_groups(seq_lens: Sequence[int], split: int, batch: int) -> list[tuple[int, ...]]:
    """The sequences a layer runs together, in sequence order: runs of up to
    ``batch`` consecutive sequences of one length, so no batch is padded (a
    pad row would count in the sums), and none mixes the first ``split``
    (the sensitivity sequences, whose experts calls the sensitivity pass
    captures and whose branches run in the same groups) with the rest. Batch
    1 gives the whole-model run's bits; a larger batch changes the last bits
    (docs/reference-model.md#determinism) for the speed of fewer, larger
    expert calls on a GPU."""
    out: list[tuple[int, ...]] = []
    group: list[int] = []
    for i, n in enumerate(seq_lens):
        if group and (len(group) == batch or n != seq_lens[group[0]] or i == split):
            out.append(tuple(group))
            group = []
        group.append(i)
    if group:
        out.append(tuple(group))
    return out


@dataclass
class WalkResult:
    layers: list  # LayerSums per layer
    head: HeadSums
    pieces: dict  # layer -> sensitivity piece (name -> array)
    kl_sums: dict  # branch key -> sum of KL over the sensitivity sequences' positions
    sens_tokens: int


def _save_npz(path: Path, arrays: dict) -> None:
    import io

    from ds4quant.artifact.atomic import atomic_write_bytes

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue())


class _States:
    """Hidden streams in the work folder: states/LAYER/KEY/SEQ.npy (float32).

    A DS4 Flash sequence of 2,048 tokens has 128 MB of streams: writing them
    and reading the next batch's run on background threads while the layer
    computes (at most ``_PENDING`` writes in flight, holding their tensors);
    ``flush`` waits for every write, and the journal records a layer finished
    only after it. Reads and writes have a thread each: a layer reads only
    states written before the last ``flush`` (its own inputs), so a read
    never needs to wait for a write, and a batch's reads do not queue behind
    the previous batch's writes."""

    _PENDING = 2

    def __init__(self, journal: Journal, device):
        from concurrent.futures import ThreadPoolExecutor

        self.j, self.device = journal, device
        self._io = ThreadPoolExecutor(1)  # writes, in order
        self._rd = ThreadPoolExecutor(1)  # reads of flushed states
        self._writes: list = []
        self._reads: dict = {}

    def _path(self, layer: int, key: str, i: int) -> Path:
        return self.j.states(layer) / key / f"{i}.npy"

    def put(self, layer: int, key: str, i: int, h) -> None:
        p = self._path(layer, key, i)
        p.parent.mkdir(parents=True, exist_ok=True)

        def write(h=h.detach()) -> None:
            try:
                with open(p, "wb") as f:
                    np.save(f, h.cpu().numpy())
            except OSError as e:  # a failed write names its file (a full disk's error does not)
                from ds4quant.artifact.atomic import with_path

                raise with_path(e, p) from None

        while len(self._writes) >= self._PENDING:
            self._writes.pop(0).result()
        self._writes.append(self._io.submit(write))

    def prefetch(self, layer: int, key: str, i: int) -> None:
        """Start reading a state ``get`` will ask for next."""
        where = (layer, key, i)
        if where not in self._reads:
            self._reads[where] = self._rd.submit(np.load, self._path(*where))

    def get(self, layer: int, key: str, i: int):
        import torch

        pending = self._reads.pop((layer, key, i), None)
        arr = pending.result() if pending is not None else np.load(self._path(layer, key, i))
        return torch.from_numpy(arr).to(self.device)

    def get_many(self, layer: int, key: str, seqs: Sequence[int]):
        """The states of ``seqs`` as one batch [len(seqs), S, hc, H] on the device."""
        import torch

        parts = [self.get(layer, key, i) for i in seqs]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def put_many(self, layer: int, key: str, seqs: Sequence[int], h) -> None:
        """``put`` each sequence's row of the batch ``h`` [len(seqs), S, hc, H]."""
        for j, i in enumerate(seqs):
            self.put(layer, key, i, h[j:j + 1])

    def flush(self) -> None:
        """Every state put so far is in its file (a failed write raises here)."""
        while self._writes:
            self._writes.pop(0).result()

    def close(self) -> None:
        for f in self._reads.values():
            f.cancel()
        self._reads.clear()
        try:
            self.flush()
        finally:
            self._io.shutdown(wait=True)
            self._rd.shutdown(wait=True)


@contextlib.contextmanager
def _experts_hook(experts, fn):
    def hook(module, args, kwargs):
        hidden = args[0] if len(args) > 0 else kwargs["hidden_states"]
        idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
        weights = args[2] if len(args) > 2 else kwargs["top_k_weights"]
        fn(module, hidden, idx, weights)

    h = experts.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        h.remove()


def meter_for(n_layer: int, journal: Journal, seqs: Sequence[Sequence[int]]) -> Meter:
    """The run's meter: one counted item per remaining layer and the head, then writing the files."""
    left = n_layer + 1 - (journal.finished + 1)
    return Meter("calibrate", left, "layer", total_work=left * sum(len(s) for s in seqs), then=("writing files",))


def walk(sm, seqs: Sequence[Sequence[int]], journal: Journal, sens: Optional[SensitivityPass], stream, *,
         meter: Optional[Meter] = None, progress: Optional[ProgressFn] = None) -> WalkResult:
    """Run ``seqs`` through ``sm`` (a ``StreamedModel``; ``stream`` its
    ``model.Stream``: devices per layer, memory plan) layer by layer from the
    journal's first unfinished layer; see the module doc. ``progress`` gets a
    TICK per sequence and a STEP per layer and for the head (``meter``'s
    events; detail ``tokens``: tokens through the layers so far)."""
    states = _States(journal, stream.device)
    try:
        return _walk(sm, seqs, journal, sens, stream, states, meter, progress)
    finally:
        states.close()


def _walk(sm, seqs, journal: Journal, sens, stream, states: _States, meter, progress) -> WalkResult:
    cfg = sm.config
    n_layer, n_exp = cfg.num_hidden_layers, cfg.n_routed_experts
    batches = sm.batches(seqs, batch_size=1)
    n_sens = min(sens.seqs, len(seqs)) if sens is not None else 0
    groups = batch_groups([len(s) for s in seqs], n_sens, stream.batch)
    grouped = [batches[g[0]] if len(g) == 1 else sm.batches([seqs[i] for i in g], batch_size=len(g))[0]
               for g in groups]
    # the sensitivity sequences' groups come first: their experts calls are captured, one a group,
    # and their branches run in the same groups
    n_sg = sum(1 for g in groups if g[0] < n_sens)
    tokens = sum(len(s) for s in seqs)
    start = journal.finished + 1
    meter = meter or meter_for(n_layer, journal, seqs)
    done_tokens = 0

    def tick(item: str, i: int) -> None:
        nonlocal done_tokens
        done_tokens += len(seqs[i])
        ev = meter.tick(f"{item}: sequence {i + 1}/{len(seqs)}", work=len(seqs[i]), tokens=done_tokens)
        if progress is not None:
            progress(ev)

    def step(item: str) -> None:
        ev = meter.step(item, work=0, tokens=done_tokens)
        if progress is not None:
            progress(ev)

    if start == 0:  # the embeddings are cheap; a run killed before layer 0 finished redoes them
        for i, b in enumerate(batches):
            states.put(0, MAIN, i, sm.embed(b))
        states.flush()
    sm.release_embed()
    journal.drop_stale_states()
    for L in range(start, n_layer):
        sums = LayerSums(L, n_exp, cfg.hidden_size, cfg.moe_intermediate_size)
        calls: list = []
        rec = {"on": False, "i": -1}

        def on_experts(module, hidden, idx, weights):
            if not rec["on"]:
                return
            sums.on_experts(module, hidden, idx)
            if rec["i"] < n_sg:
                calls.append((hidden.detach().clone(), idx.detach().clone(), weights.detach().clone()))

        states.device = stream.layer_device(L)
        with sm.layer(L, states.device, stream.plan.expert_cache_for(states.device)) as layer:
            experts = layer.mlp.experts
            sums.attach(layer)
            try:
                with _experts_hook(experts, on_experts):
                    for gi, (g, b) in enumerate(zip(groups, grouped)):
                        h = states.get_many(L, MAIN, g)
                        if gi + 1 < len(groups):
                            for i in groups[gi + 1]:
                                states.prefetch(L, MAIN, i)
                        rec.update(on=True, i=gi)
                        sums.begin()
                        out = sm.run_layer(layer, b, h)
                        sums.end()
                        rec["on"] = False
                        states.put_many(L + 1, MAIN, g, out)
                        for i in g:
                            tick(f"layer {L}", i)
            finally:
                sums.detach()
            if sens is not None:
                piece, branches = sens.layer(L, experts, calls, sums)
                calls.clear()
                for key in sens.keys_entering(L):
                    for gi in range(n_sg):
                        out = sm.run_layer(layer, grouped[gi], states.get_many(L, key, groups[gi]))
                        states.put_many(L + 1, key, groups[gi], out)
                for gi in range(n_sg if branches else 0):
                    h = states.get_many(L, MAIN, groups[gi])  # read once for every branch starting here
                    for br in branches:
                        layer.mlp.experts = br.experts(experts, gi)
                        try:
                            out = sm.run_layer(layer, grouped[gi], h)
                        finally:
                            layer.mlp.experts = experts
                        states.put_many(L + 1, br.key, groups[gi], out)
                _save_npz(journal.sens_path(L), piece)
        from ds4quant.artifact.atomic import atomic_write_bytes

        states.flush()  # the next layer's inputs are on disk before the journal says so
        journal.sums_path(L).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(journal.sums_path(L), sums.to_bytes())
        journal.finish_layer(L)
        step(f"layer {L}")

    states.device = stream.device
    head = HeadSums()
    kl_sums: dict = {}
    with sm.head() as hd:
        head.attach(hd)
        refs = []
        try:
            for i, b in enumerate(batches):
                h = states.get(n_layer, MAIN, i)
                head.begin()
                logits = sm.logits(hd, h)
                head.end()
                if i < n_sens:
                    refs.append(ref_logp(logits[0]))
                tick("head", i)
        finally:
            head.detach()
        if sens is not None:
            for key in sens.keys_entering(n_layer):
                total = 0.0
                for i in range(n_sens):
                    total += kl_sum(refs[i], sm.logits(hd, states.get(n_layer, key, i))[0])
                kl_sums[key] = total
    step("head")
    layers = [LayerSums.from_bytes(L, journal.sums_path(L).read_bytes()) for L in range(n_layer)]
    pieces = {}
    if sens is not None:
        for L in range(n_layer):
            with np.load(journal.sens_path(L)) as z:
                pieces[L] = {k: z[k] for k in z.files}
    return WalkResult(layers, head, pieces, kl_sums, sum(len(s) for s in seqs[:n_sens]))
