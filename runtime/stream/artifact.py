"""The candidate's weights: an artifact's dense tensors and the runtime's experts.

Every non-expert tensor of a layer is the artifact's own, decoded
(``ArtifactView.dense``; GGUF name -> official name -> transformers name
through ``sources.naming``), so a wrong dense conversion shows as well as a
wrong expert. Routed experts run on the runtime's owners: ``runtime.load``
(the artifact on a placement, in a numeric mode; in process or on cluster
ranks) and its ``experts(layer)`` module, called as transformers' experts
are. That is the candidate ``verify --fidelity`` builds, one layer at a time.

The architecture (transformers' configuration) comes from the source folder
the artifact was converted from, or is given.

    with ArtifactWeights("out/art", placement=None, mode="exact", source_dir="samples/ds4-tiny") as w:
        sm = StreamedModel(w)
"""

from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np

from ds4quant import names
from ds4quant.errors import BadInputError, CorruptDataError
from ds4quant.runtime.mode import Mode

__all__ = ["ArtifactWeights"]


class ArtifactWeights:
    """An artifact as a streamed model's weights (a context manager; ``close``
    frees the executor and the view when this object opened them).

    artifact: a folder, .gguf, first split, or an open ArtifactView;
    placement: None (one CPU owner), a placement file, a mapping or a
    ``Placement``; mode: ``Mode`` or its name; source_dir or config: where the
    transformers configuration comes from; executor: an already loaded
    ``runtime`` Executor to use instead of loading one (not closed here).
    """

    def __init__(self, artifact: Any, placement: Any = None, mode: "Mode | str" = Mode.EXACT, *,
                 source_dir: "Optional[str | os.PathLike[str]]" = None, config: Any = None, executor: Any = None):
        from ds4quant.runtime.stream.config import build_skeleton, reference_config
        from ds4quant.runtime.torch_env import quiet_transformers
        from ds4quant.sources.naming import hf_name, official_name

        if (source_dir is None) == (config is None):
            raise BadInputError("the candidate needs the model's configuration: give source_dir or config",
                                where="ArtifactWeights")
        self.config = config if config is not None else reference_config(source_dir)
        self.n_layers = int(self.config.num_hidden_layers)
        self.mode = Mode.parse(mode)
        self._own_view = not hasattr(artifact, "expert_data")
        if self._own_view:
            from ds4quant.artifact.view import open_artifact

            self.view = open_artifact(artifact)
        else:
            self.view = artifact
        self.where = str(getattr(self.view, "first_file", artifact))
        self._exec = executor
        self._own_exec = executor is None
        try:
            with quiet_transformers():
                skel = build_skeleton(self.config)
            self._shapes = {k: (tuple(v.shape), v.dtype) for k, v in skel.state_dict().items()}
            del skel
            self._layers: dict[int, dict[str, str]] = {}
            self._globals: dict[str, str] = {}
            for name in self.view.tensors:
                if names.parse_stack(name) is not None:
                    continue
                off = official_name(name)
                if off is None:
                    raise CorruptDataError("no official tensor name maps to this artifact tensor",
                                           where=f"{self.where}: {name}")
                hf, _ = hf_name(off)
                if hf.startswith("model.layers."):
                    layer = int(hf.split(".")[2])
                    self._layers.setdefault(layer, {})[hf.split(".", 3)[3]] = name
                else:
                    self._globals[hf] = name
            if self._exec is None:
                from ds4quant import runtime

                self._exec = runtime.load(self.view, placement, self.mode)
        except BaseException:
            self.close()
            raise

    @property
    def executor(self):
        """The runtime Executor running the routed experts."""
        return self._exec

    def _read(self, hf: str, name: str):
        import torch

        want = self._shapes.get(hf)
        if want is None:
            raise CorruptDataError(f"the model has no parameter {hf}", where=f"{self.where}: {name}")
        shape, dtype = want
        got = np.asarray(self.view.dense(name))
        if tuple(got.shape) != shape:
            if tuple(d for d in got.shape if d != 1) != tuple(d for d in shape if d != 1):
                raise CorruptDataError(f"shape {list(got.shape)} in the artifact, {list(shape)} in the model ({hf})",
                                       where=f"{self.where}: {name}")
            got = got.reshape(shape)  # only unit dimensions differ ([n] vs [1, n])
        return torch.from_numpy(np.ascontiguousarray(got)).to(dtype)

    def layer_state(self, layer: int) -> dict:
        """{name inside the layer: tensor} of every non-expert tensor of ``layer``."""
        got = self._layers.get(layer)
        if got is None:
            raise CorruptDataError(f"the artifact has no tensors for layer {layer}", where=self.where)
        prefix = f"model.layers.{layer}."
        return {k: self._read(prefix + k, n) for k, n in sorted(got.items())}

    def global_state(self, part: str) -> dict:
        from ds4quant.runtime.stream.source import GLOBAL_PARTS

        out = {}
        for hf in GLOBAL_PARTS[part]:
            name = self._globals.get(hf)
            if name is None and hf == "lm_head.weight" and self.config.tie_word_embeddings:
                name, hf_src = self._globals.get("model.embed_tokens.weight"), "model.embed_tokens.weight"
            else:
                hf_src = hf
            if name is None:
                raise CorruptDataError(f"the artifact holds no tensor for the model's {hf}", where=self.where)
            out[hf] = self._read(hf_src, name)
        return out

    def experts_module(self, layer: int):
        """The executor's routed experts of ``layer`` (runtime owners, placement, mode)."""
        return self._exec.experts(layer)

    def layer_bytes(self, layer: int) -> int:
        """float32 bytes of the layer's decoded dense tensors (the experts live on the owners)."""
        prefix = f"model.layers.{layer}."
        return sum(4 * int(np.prod(self._shapes[prefix + k][0], dtype=np.int64))
                   for k in self._layers.get(layer, {}) if prefix + k in self._shapes)

    def expert_bytes(self, layer: int) -> int:
        return 0  # resident on the owners for the whole run, counted by the executor

    def experts_fp4(self, layer: int) -> bool:
        return False  # no decoded experts here: the owners run them

    def global_bytes(self, part: str) -> int:
        from ds4quant.runtime.stream.source import GLOBAL_PARTS

        return sum(4 * int(np.prod(self._shapes[h][0], dtype=np.int64)) for h in GLOBAL_PARTS[part])

    def close(self) -> None:
        if self._own_exec and self._exec is not None:
            self._exec.close()
        self._exec = None
        if self._own_view and getattr(self, "view", None) is not None:
            self.view.close()
            self.view = None

    def __enter__(self) -> "ArtifactWeights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
