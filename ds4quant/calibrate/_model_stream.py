"""A stand-in for ``ds4quant.runtime.stream.StreamedModel`` over a whole loaded
reference model (same method names), used until the streamed forward lands.
It holds every layer at once: no memory bound."""

from __future__ import annotations

import contextlib


class ModelStream:
    def __init__(self, source_dir, *, device: str = "cpu", threads: int = 1):
        from ds4quant.runtime.reference import load_reference

        self.model = load_reference(source_dir)
        self.config = self.model.config
        self.n_layers = len(self.model.model.layers)
        self.device = device

    def batches(self, seqs, batch_size: int = 1, pad_id=None):
        return [tuple(s) for s in seqs]

    def _ids(self, batch):
        import torch

        return torch.tensor([list(batch)], dtype=torch.long)

    def embed(self, batch):
        m = self.model.model
        e = m.embed_tokens(self._ids(batch))
        return e.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()

    @contextlib.contextmanager
    def layer(self, index: int):
        yield self.model.model.layers[index]

    def run_layer(self, layer, batch, h):
        import torch
        from transformers.masking_utils import create_sliding_window_causal_mask

        m = self.model.model
        ids = self._ids(batch)
        emb = h[:, :, 0, :]
        position_ids = torch.arange(emb.shape[1]).unsqueeze(0)
        mask = create_sliding_window_causal_mask(config=self.config, inputs_embeds=emb, attention_mask=None,
                                                 cache=None, position_ids=position_ids)
        pe = {"main": m.rotary_emb(emb, position_ids=position_ids, layer_type="main"),
              "compress": m.rotary_emb(emb, position_ids=position_ids, layer_type="compress")}
        with torch.no_grad():
            return layer(h, position_embeddings=pe, position_ids=position_ids, attention_mask=mask, input_ids=ids,
                         cache=None)

    @contextlib.contextmanager
    def head(self):
        yield self.model

    def logits(self, head, h):
        import torch

        with torch.no_grad():
            return head.lm_head(head.model.norm(head.model.hc_head(h)))
