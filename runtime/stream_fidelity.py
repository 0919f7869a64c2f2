"""Fidelity's forward passes through the layer-streamed model.

At DeepSeek-V4-Flash size neither the reference nor the candidate fits as a
whole model, and greedy generation needs every layer for every token. What
fidelity needs streams: the logits at the scored positions of the evaluation
sequences, and the exact-copy protocol teacher-forced (a trial passes when
every answer token is the argmax given the correct prefix: one forward of
prompt + answer). ``StreamedFidelity`` runs both on any weight provider
(``SourceWeights`` for the reference, ``ArtifactWeights`` for the candidate on
any placement), with the CSA indexer's ties broken by position
(``indexer_ties``) and, optionally, a routing shortcut (``routing_approx``)
in every layer, and hashes the routed experts' outputs in call order.

Batches are formed as the whole-model harness forms them (every evaluation
sequence in one right-padded batch; protocol trials in chunks of 64 padded
with eos), so on CPU the logits are the whole model's bits. An evaluation
larger than ``BATCH_TOKENS`` padded tokens, which no whole model at DS4
Flash's size runs, goes in consecutive batches of at most that many
(``eval_batch``), so one batch's working set stays bounded.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ds4quant.runtime.stream.model import Observer


#: the most padded tokens (rows x longest row) one evaluation batch holds: DS4 Flash's
#: 16k-token evaluation is one batch, a larger one several. The rule reads the sequences
#: alone, so a reference base and every candidate get the same batches on any machine (a
#: row's bits depend on its batch neighbours: docs/reference-model.md#determinism).
BATCH_TOKENS = 16384


def eval_batch(seqs: Sequence[Sequence[int]]) -> int:
    """Rows per evaluation batch: all of them while they hold at most
    ``BATCH_TOKENS`` padded tokens, else as many as that holds (at least one)."""
    width = max((len(s) for s in seqs), default=1)
    if len(seqs) * width <= BATCH_TOKENS:
        return max(1, len(seqs))
    return max(1, BATCH_TOKENS // width)


class _Hooks(Observer):
    """Per layer: stable indexer ties, the routing shortcut, the routed-output hash,
    and the logits kept at the wanted positions."""

    def __init__(self, want: Mapping[int, list], experts_per_token=None, drop=None, moe=None):
        self.want = want  # batch index -> [(row, position)]
        self.kept: dict = {}
        self.routed = hashlib.sha256()
        self.k, self.drop = experts_per_token, drop
        self.moe = moe  # a MoeTrace: record the MoE blocks (reference) or compare with them (candidate)
        self._batch = 0
        self._quiet = False  # set while the MoE trace re-runs a block: its calls are no part of the pass
        self._open: list = []
        self._handles: list = []

    def on_batch_start(self, layer: int, index: int, batch, hidden) -> None:
        self._batch = index

    def on_layer_start(self, layer: int, module) -> None:
        from ds4quant.runtime.indexer_ties import stable_indexer

        from ds4quant.runtime.routing_approx import route_block

        cms = [stable_indexer(module)]
        if self.k is not None or self.drop:
            cms.append(route_block(module.mlp, int(module.mlp.gate.num_experts), self.k,
                                   tuple((self.drop or {}).get(layer, ()))))
        for cm in cms:
            cm.__enter__()
            self._open.append(cm)

        def hook(mod, args, out, layer=layer):
            import torch

            if self._quiet:
                return
            self.routed.update(int(layer).to_bytes(4, "little"))
            self.routed.update(np.ascontiguousarray(out.detach().to("cpu", torch.float32).numpy()).tobytes())

        self._handles.append(module.mlp.experts.register_forward_hook(hook))
        if self.moe is not None:
            def block_hook(mod, args, kwargs, out, layer=layer):
                if self._quiet:
                    return
                h = args[0] if args else kwargs["hidden_states"]
                ids = kwargs.get("input_ids", args[1] if len(args) > 1 else None)
                self._quiet = True
                try:
                    self.moe.block(layer, self._batch, mod, h, ids, out)
                finally:
                    self._quiet = False

            self._handles.append(module.mlp.register_forward_hook(block_hook, with_kwargs=True))

    def on_layer_end(self, layer: int, module) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        while self._open:
            self._open.pop().__exit__(None, None, None)

    def on_logits(self, index: int, batch, logits) -> None:
        pos = self.want.get(index)
        if pos:
            r = [p[0] for p in pos]
            c = [p[1] for p in pos]
            self.kept[index] = logits[r, c].detach().to("cpu").float().clone()


class MoeTrace:
    """Per-layer MoE errors through the streamed forward, as the whole-model
    stage defines them (docs/fidelity-figures.md, layer-streamed): ``local``, the candidate's
    block fed the reference's own block input; ``propagated``, the candidate's
    block output in its own run; each ``||cand - ref|| / ||ref||`` over every
    token of the evaluation.

    The reference pass (``record``) writes each block's input, token ids and
    output to ``folder``, one file per layer and batch, so host memory holds
    one batch's; the candidate pass (``compare``) reads them back layer by
    layer. ``folder`` needs 2 x tokens x hidden x 4 bytes per MoE layer.
    """

    def __init__(self, folder, *, compare: bool = False):
        from pathlib import Path

        self.folder = Path(folder)
        self.compare = compare
        self.sums: dict = {}  # layer -> [local num^2, propagated num^2, den^2] (float64)

    def _file(self, layer: int, batch: int):
        return self.folder / f"moe-{layer}-{batch}.pt"

    def block(self, layer: int, batch: int, mod, hidden, ids, out) -> None:
        import torch

        if not self.compare:
            torch.save({"h": hidden.detach().to("cpu"), "ids": None if ids is None else ids.detach().to("cpu"),
                        "out": out.detach().to("cpu", torch.float32)}, self._file(layer, batch))
            return
        ref = torch.load(self._file(layer, batch), weights_only=True)
        dev = hidden.device
        with torch.no_grad():
            local = mod(ref["h"].to(dev), input_ids=None if ref["ids"] is None else ref["ids"].to(dev))
        r = ref["out"].double()
        acc = self.sums.setdefault(layer, [0.0, 0.0, 0.0])
        acc[0] += float(((local.detach().to("cpu").double() - r) ** 2).sum())
        acc[1] += float(((out.detach().to("cpu").double() - r) ** 2).sum())
        acc[2] += float((r ** 2).sum())

    def errors(self) -> dict:
        """{layer: (local, propagated)} relative errors of the compared pass."""
        def rel(num2: float, den2: float) -> float:
            return (num2 ** 0.5) / (den2 ** 0.5) if den2 > 0 else (0.0 if num2 == 0 else float("inf"))

        return {L: (rel(a[0], a[2]), rel(a[1], a[2])) for L, a in sorted(self.sums.items())}


@dataclass
class StreamedPass:
    logits: Any  # float32 [N, V] at the wanted positions, in order
    routed_sha256: str
    copy: Optional[Any] = None  # CopySets


def streamed_logits(sm, seqs: Sequence[Sequence[int]], positions, pad: int, *, experts_per_token=None,
                    drop=None, batch_size: Optional[int] = None, moe: Optional[MoeTrace] = None,
                    max_memory=None) -> StreamedPass:
    """Logits at ``positions`` [(row, position)] of ``seqs`` through ``sm``
    (with ``moe``: its MoE blocks recorded or compared, see ``MoeTrace``), within
    the host budget ``max_memory`` (``plan_memory``: on a GPU the decoded experts
    are kept there; hidden states past the budget go to a temporary memmap), in
    batches of ``batch_size`` rows (default ``eval_batch``)."""
    import contextlib
    import tempfile

    import torch

    from ds4quant.runtime.stream.memory import plan_memory
    from ds4quant.runtime.stream.model import stream_forward

    bs = batch_size or eval_batch(seqs)
    want: dict = {}
    order = []
    for r, c in positions:
        b, row = divmod(r, bs)
        want.setdefault(b, []).append((row, c))
        order.append(b)
    obs = _Hooks(want, experts_per_token, drop, moe)
    batches = sm.batches(seqs, batch_size=bs, pad_id=pad)
    plan = plan_memory(sm.weights, [b.shape for b in batches], max_memory, str(sm.device))
    spill = plan.store_kind == "memmap"
    with tempfile.TemporaryDirectory(prefix="ds4quant-stream-") if spill else contextlib.nullcontext() as work:
        stream_forward(sm, batches, observer=obs, keep_logits=False, plan=plan, work_dir=work)
    parts = [obs.kept[b] for b in sorted(obs.kept)]
    logits = torch.cat(parts) if parts else torch.zeros((0, int(sm.config.vocab_size)))
    if any(a > b for a, b in zip(order, order[1:])):
        # positions not in row order: the batches' rows come back in ``positions``' order
        by_batch = sorted(range(len(order)), key=order.__getitem__)  # stable: each batch's own order
        logits = logits[torch.argsort(torch.tensor(by_batch))]
    return StreamedPass(logits, obs.routed.hexdigest())


def streamed_copy_sets(sm, tok, task, n_sets: int, *, experts_per_token=None, drop=None, batch: int = 64,
                       max_memory=None):
    """The exact-copy protocol over ``n_sets`` seeded identifier sets, teacher-forced
    through ``sm`` (``copy_sets.CopySets``; the protocol's own set's ExactCopyResult)."""
    from ds4quant.runtime import fidelity as fd
    from ds4quant.runtime.copy_sets import CopySets, check_sets

    check_sets(n_sets)
    t = fd.as_tokenizer(tok)
    seeds = tuple(fd.PROTOCOL_SEED + i for i in range(n_sets))
    trials = [tr for s in seeds for tr in fd.protocol_trials(task, seed=s)]
    pairs = [fd.trial_ids(t, tr) for tr in trials]
    seqs = [p + a for p, a in pairs]
    positions = [(i, len(p) - 1 + k) for i, (p, a) in enumerate(pairs) for k in range(len(a))]
    got = streamed_logits(sm, seqs, positions, t.eos_token_id or 0, experts_per_token=experts_per_token,
                          drop=drop, batch_size=batch, max_memory=max_memory).logits.argmax(-1).tolist()
    checks, at = [], 0
    for p, a in pairs:
        g = got[at:at + len(a)]
        at += len(a)
        wrong = [k for k in range(len(a)) if g[k] != a[k]]
        checks.append((not wrong, wrong[0] if wrong else -1, g[wrong[0]] if wrong else -1))
    per = len(trials) // n_sets
    passes = tuple(sum(ok for ok, _, _ in checks[i * per:(i + 1) * per]) for i in range(n_sets))
    first = fd.copy_result(t, task, seeds[0], trials[:per], checks[:per])
    return CopySets(seeds, passes, per), first
