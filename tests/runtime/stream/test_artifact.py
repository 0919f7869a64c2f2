"""The streamed candidate (ArtifactWeights) gives verify's whole-model candidate, bit for bit.

verify --fidelity's candidate is the reference architecture with every dense
tensor overwritten by the artifact's decoded one and every layer's routed
experts swapped for the executor's (ds4quant.verify._candidate); streamed,
the same numbers come one layer at a time.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ds4quant import runtime  # noqa: E402
from ds4quant.artifact.view import open_artifact  # noqa: E402
from ds4quant.convert import convert  # noqa: E402
from ds4quant.errors import BadInputError  # noqa: E402
from ds4quant.runtime.reference import load_reference, moe_blocks, swap_experts, torch_threads  # noqa: E402
from ds4quant.runtime.stream import ArtifactWeights, StreamedModel, stream_forward  # noqa: E402

TINY = Path(__file__).resolve().parents[3] / "samples" / "ds4-tiny"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "tiny"
    convert(TINY, out, "mxfp4", force=True, command=["test"])
    return out


def _whole_candidate(view, seqs, pad):
    """verify's way: dense tensors into a copy of the reference, experts swapped."""
    from ds4quant.verify import _candidate as C

    cand = copy.deepcopy(load_reference(TINY))
    assert C.dense_into(cand, view) == []
    with runtime.load(view, None, "exact") as rt:
        old = {i: swap_experts(cand, i, rt.experts(i)) for i, _ in moe_blocks(cand)}
        try:
            return C.logits_of(cand, seqs, pad)
        finally:
            for i, m in old.items():
                swap_experts(cand, i, m)


def test_streamed_candidate_is_verify_candidate(artifact):
    rng = np.random.default_rng(9)
    seqs = [[int(t) for t in rng.integers(3, 512, n)] for n in (36, 21)]
    with torch_threads(1), open_artifact(artifact) as view:
        want = _whole_candidate(view, seqs, 2)
        with ArtifactWeights(view, source_dir=TINY) as w:
            sm = StreamedModel(w)
            got = stream_forward(sm, sm.batches(seqs, batch_size=2, pad_id=2))
            assert w.layer_bytes(1) > 0 and w.expert_bytes(1) == 0
    assert torch.equal(want, got[0])


def test_needs_a_configuration(artifact):
    with pytest.raises(BadInputError, match="give source_dir or config"):
        ArtifactWeights(artifact)
