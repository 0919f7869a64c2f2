"""The layer-streamed DeepSeek-V4 forward.

``StreamedModel`` holds the model's skeleton on the meta device and makes one
piece real at a time: the embedding, one decoder layer (transformers' own
``DeepseekV4DecoderLayer``: attention, compressor, indexer, hyper-connections,
router, shared expert; its routed experts are the weight provider's module),
or the head. ``stream_forward`` drives it: embed every batch, then for each
layer materialize it, run it on every batch (hidden states read from and
written back to a store), release it; then the hyper-connection head, the
final norm and ``lm_head``.

Each layer is called with what ``DeepseekV4Model.forward`` gives it (the same
sliding-window causal mask from transformers' own mask builder, the same
"main" and "compress" rotary tables, position ids, token ids; no cache), so
with the reference's weights the logits are the whole model's, bit for bit,
at the same torch thread count and the same batching (a batch row is not
bitwise independent of its batch neighbours: docs/reference-model.md#determinism).

    with SourceWeights(src) as w:
        sm = StreamedModel(w)
        logits = stream_forward(sm, sm.batches(seqs), observer=MyObserver())
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

from ds4quant.errors import BadInputError
from ds4quant.progress import Meter, ProgressFn

__all__ = ["Batch", "Observer", "StreamedModel", "stream_forward", "parse_device"]


@dataclass(frozen=True)
class Batch:
    """Token sequences run together: ``ids`` int64 [B, S] (right-padded with
    ``pad_id``), ``lengths`` the true length of each row."""

    ids: Any
    lengths: tuple[int, ...]
    pad_id: int

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.ids.shape[0]), int(self.ids.shape[1])


class Observer:
    """Per-layer hooks of ``stream_forward``; override what you need (all no-ops).

    ``module`` is the live ``DeepseekV4DecoderLayer`` on the run's device: add
    forward (pre-)hooks to its submodules in ``on_layer_start`` and remove them
    in ``on_layer_end``. ``hidden`` is the hyper-connection streams
    [B, S, hc_mult, H] entering (``on_batch_start``) or leaving
    (``on_batch_end``) the layer; do not modify it in place.
    """

    def on_layer_start(self, layer: int, module) -> None:
        pass

    def on_batch_start(self, layer: int, index: int, batch: Batch, hidden) -> None:
        pass

    def on_experts(self, layer: int, index: int, experts, hidden, top_k_index, top_k_weights) -> None:
        """The routed experts' call: hidden [T, H] (the MoE input rows), top_k_index
        int64 [T, k] (hash layers: the tid2eid rows), top_k_weights [T, k]."""

    def on_batch_end(self, layer: int, index: int, batch: Batch, hidden) -> None:
        pass

    def on_layer_end(self, layer: int, module) -> None:
        pass

    def on_head_start(self, head) -> None:
        """``head`` has ``hc_head``, ``norm`` and ``lm_head`` (live modules)."""

    def on_logits(self, index: int, batch: Batch, logits) -> None:
        """float32 [B, S, vocab] of batch ``index``."""


def parse_device(device: Any) -> str:
    """"cpu", "cuda" or "cuda:N" (a torch.device is accepted); anything else is refused."""
    text = str(device)
    if text == "cpu" or text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise BadInputError(f"device must be cpu, cuda or cuda:N, got {device!r}", where="--device")


class _Head:
    def __init__(self, hc_head, norm, lm_head):
        self.hc_head, self.norm, self.lm_head = hc_head, norm, lm_head


class StreamedModel:
    """A weight provider's model, run one layer at a time on ``device``.

    threads: torch's intra-op thread count while it runs (None: leave it).
    """

    def __init__(self, weights, *, device: Any = "cpu", threads: Optional[int] = None):
        import torch

        from ds4quant.runtime.stream.config import build_skeleton
        from ds4quant.runtime.torch_env import quiet_transformers

        self.weights = weights
        self.config = weights.config
        self.n_layers = int(weights.n_layers)
        self.device = torch.device(parse_device(device))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise BadInputError(f"device {device} asked for, but torch sees no CUDA device", where="--device")
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise BadInputError(f"threads must be an int >= 1, got {threads!r}", where="threads")
        self.threads = threads
        with quiet_transformers():
            self._skeleton = build_skeleton(self.config)
        self._embed = None
        # the model-level rotary tables (inverse frequencies from the config; the
        # tables follow each batch's device)
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

        self._rotary = DeepseekV4RotaryEmbedding(self.config)

    # -- inputs ------------------------------------------------------------------

    def batches(self, seqs: Sequence[Sequence[int]], batch_size: int = 1, pad_id: Optional[int] = None) -> list:
        """``seqs`` cut into Batches of ``batch_size`` rows, right-padded with
        ``pad_id`` (default: the config's pad token, else 0)."""
        import torch

        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise BadInputError(f"batch_size must be an int >= 1, got {batch_size!r}", where="batch_size")
        if pad_id is None:
            pad_id = self.config.pad_token_id if self.config.pad_token_id is not None else 0
        vocab = int(self.config.vocab_size)
        out = []
        for start in range(0, len(seqs), batch_size):
            group = [list(s) for s in seqs[start:start + batch_size]]
            for j, s in enumerate(group):
                if not s:
                    raise BadInputError(f"sequence {start + j} is empty", where="tokens")
                bad = [t for t in s if not isinstance(t, int) or not 0 <= t < vocab]
                if bad:
                    raise BadInputError(f"sequence {start + j}: token id {bad[0]!r} is outside 0..{vocab - 1}",
                                        where="tokens")
            width = max(len(s) for s in group)
            ids = torch.full((len(group), width), int(pad_id), dtype=torch.long)
            for j, s in enumerate(group):
                ids[j, :len(s)] = torch.tensor(s, dtype=torch.long)
            out.append(Batch(ids, tuple(len(s) for s in group), int(pad_id)))
        if not out:
            raise BadInputError("no token sequences given", where="tokens")
        return out

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        if self.threads is None:
            yield
            return
        from ds4quant.runtime.torch_env import torch_threads

        with torch_threads(self.threads):
            yield

    # -- the pieces --------------------------------------------------------------

    def _ensure_embed(self):
        if self._embed is None:
            m = self._skeleton.model
            state = self.weights.global_state("embed")
            m.embed_tokens.load_state_dict({"weight": state["model.embed_tokens.weight"]}, assign=True)
            self._embed = m.embed_tokens.to(self.device)
        return self._embed

    def _context(self, batch: Batch, embeds) -> dict:
        """What DeepseekV4Model.forward hands every layer for this batch."""
        import torch
        from transformers.masking_utils import create_sliding_window_causal_mask

        dev = embeds.device
        ids = batch.ids.to(dev)
        position_ids = torch.arange(embeds.shape[1], device=dev).unsqueeze(0)
        mask = create_sliding_window_causal_mask(config=self.config, inputs_embeds=embeds, attention_mask=None,
                                                 cache=None, position_ids=position_ids)
        pe = {"main": self._rotary(embeds, position_ids=position_ids, layer_type="main"),
              "compress": self._rotary(embeds, position_ids=position_ids, layer_type="compress")}
        return {"position_embeddings": pe, "position_ids": position_ids, "attention_mask": mask, "input_ids": ids,
                "cache": None}

    def embed(self, batch: Batch):
        """The streams entering layer 0: [B, S, hc_mult, H] float32 on the device."""
        import torch

        with torch.no_grad(), self._threads():
            e = self._ensure_embed()(batch.ids.to(self.device))
            return e.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()

    def release_embed(self) -> None:
        """Give the embedding's memory back (the head is a separate piece)."""
        if self._embed is not None:
            self._embed.to("meta")
            self._embed = None

    @contextlib.contextmanager
    def layer(self, layer: int, device: Any = None, expert_cache: "Optional[int] | str" = "keep") -> Iterator[Any]:
        """Decoder layer ``layer`` materialized on ``device`` (default the model's);
        released on exit. expert_cache: bytes of decoded routed experts the
        source's experts module may keep (None: all; "keep": the provider's)."""
        import torch

        from ds4quant.runtime.stream.config import empty_layer

        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.n_layers:
            raise BadInputError(f"layer {layer!r} is outside 0..{self.n_layers - 1}", where="layer")
        dev = self.device if device is None else torch.device(parse_device(device))
        experts = self.weights.experts_module(layer)
        if hasattr(experts, "expert_weights"):
            experts.device = dev
            if expert_cache != "keep":
                experts.cache_bytes = expert_cache
        mod = empty_layer(self.config, layer, "meta", experts=experts)
        state = self.weights.layer_state(layer)
        res = mod.load_state_dict(state, strict=False, assign=True)
        if res.unexpected_keys:
            from ds4quant.errors import CorruptDataError

            raise CorruptDataError(f"layer {layer}: the weights hold {sorted(res.unexpected_keys)[0]}, which the "
                                   "model has no place for", where=str(getattr(self.weights, "where", "the weights")))
        from ds4quant.runtime.stream.config import fresh_rotary

        fresh_rotary(mod, self.config, dev)
        missing = sorted(k for k, _ in _named_tensors(mod) if _is_meta(mod, k))
        if missing:
            from ds4quant.errors import CorruptDataError

            raise CorruptDataError(f"layer {layer}: the weights lack {missing[0]} "
                                   f"(and {len(missing) - 1} more)" if len(missing) > 1 else
                                   f"layer {layer}: the weights lack {missing[0]}",
                                   where=str(getattr(self.weights, "where", "the weights")))
        mod = mod.to(dev).eval()
        try:
            yield mod
        finally:
            release = getattr(experts, "release", None)
            if release is not None:
                release()
            mod.to("meta")
            del mod, state

    def run_layer(self, module, batch: Batch, hidden):
        """``module`` (a materialized layer) applied to ``hidden`` [B, S, hc, H]."""
        import torch

        with torch.no_grad(), self._threads():
            embeds = hidden[:, :, 0, :]  # shape and dtype only: the mask and rotary tables read nothing else
            return module(hidden, **self._context(batch, embeds))

    @contextlib.contextmanager
    def head(self) -> Iterator[_Head]:
        """hc_head, final norm and lm_head materialized on the device."""
        m = self._skeleton
        state = self.weights.global_state("head")
        m.model.hc_head.load_state_dict({k.split(".")[-1]: v for k, v in state.items()
                                         if k.startswith("model.hc_head.")}, assign=True)
        m.model.norm.load_state_dict({"weight": state["model.norm.weight"]}, assign=True)
        m.lm_head.load_state_dict({"weight": state["lm_head.weight"]}, assign=True)
        h = _Head(m.model.hc_head.to(self.device), m.model.norm.to(self.device), m.lm_head.to(self.device))
        try:
            yield h
        finally:
            for mod in (m.model.hc_head, m.model.norm, m.lm_head):
                mod.to("meta")

    def logits(self, head: _Head, hidden):
        """float32 [B, S, vocab] from the streams leaving the last layer."""
        import torch

        with torch.no_grad(), self._threads():
            return head.lm_head(head.norm(head.hc_head(hidden)))

    def close(self) -> None:
        self._embed = None


def _named_tensors(mod):
    yield from mod.named_parameters()
    yield from mod.named_buffers()


def _is_meta(mod, name: str) -> bool:
    t = mod.get_parameter(name) if name in dict(mod.named_parameters()) else mod.get_buffer(name)
    return t.is_meta


def stream_forward(sm: StreamedModel, batches: Sequence[Batch], *, observer: Optional[Observer] = None,
                   store=None, progress: Optional[ProgressFn] = None, keep_logits: bool = True,
                   layers: Optional[Sequence[int]] = None, plan=None, work_dir=None):
    """Run ``batches`` through ``sm`` one layer at a time.

    store: where the hidden states live between layers (default a RamStore);
    observer: per-layer hooks (``Observer``); progress: a ProgressEvent per
    layer (stage "stream", unit "layer", ETA over the layers). keep_logits:
    return the logits (a float32 CPU tensor [B, S, vocab] per batch); False
    returns None (use ``observer.on_logits``: DS4 Flash's 129,280-entry
    vocabulary makes all logits of a calibration set tens of GB). layers: the
    decoder layers to run (default all, in order; fewer is for measurement).
    plan: a ``memory.MemoryPlan`` (its store, in ``work_dir`` for a memmap;
    its expert cache; its device per layer).
    """
    import torch

    from ds4quant.runtime.stream.store import RamStore

    obs = observer or Observer()
    if store is None:
        store = plan.make_store(work_dir) if plan is not None else RamStore()
    order = list(range(sm.n_layers)) if layers is None else list(layers)
    meter = Meter("stream", len(order) + 1, "layer")
    for i, b in enumerate(batches):
        store.put(i, sm.embed(b))
    sm.release_embed()
    for L in order:
        dev = sm.device if plan is None else plan.layer_devices[L]
        cache = "keep" if plan is None else plan.expert_cache_for(dev)
        with sm.layer(L, dev, cache) as mod:
            obs.on_layer_start(L, mod)
            current = {"index": -1}

            def pre(module, args, kwargs, L=L):
                hidden = args[0] if args else kwargs["hidden_states"]
                idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
                w = args[2] if len(args) > 2 else kwargs["top_k_weights"]
                obs.on_experts(L, current["index"], module, hidden, idx, w)

            handle = mod.mlp.experts.register_forward_pre_hook(pre, with_kwargs=True)
            try:
                for i, b in enumerate(batches):
                    current["index"] = i
                    h = store.get(i, dev)
                    obs.on_batch_start(L, i, b, h)
                    out = sm.run_layer(mod, b, h)
                    obs.on_batch_end(L, i, b, out)
                    store.put(i, out)
                    del h, out
            finally:
                handle.remove()
            obs.on_layer_end(L, mod)
        if progress is not None:
            progress(meter.step(f"layer {L}", batches=len(batches)))
    kept = [] if keep_logits else None
    with sm.head() as head:
        obs.on_head_start(head)
        for i, b in enumerate(batches):
            lg = sm.logits(head, store.get(i, sm.device))
            obs.on_logits(i, b, lg)
            if kept is not None:
                kept.append(lg.to("cpu", torch.float32))
            del lg
    if progress is not None:
        progress(meter.step("head", batches=len(batches)))
    return kept
