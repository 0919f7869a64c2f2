"""A streamed run fits a --max-memory budget that the model's float weights exceed.

The model is a DS4-Flash-shaped synthetic checkpoint (samples/make_synthetic.py
--preset ds4-flash-mini, 6 layers of 64 experts); the run happens in a child process so its
peak RSS (VmHWM) above its footprint before the run is this run's alone. Its logits are the same bits as an
unbounded run in this process. A budget below one layer's need is refused
before anything runs, naming the layer and the bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ds4quant.errors import BadInputError, BudgetError  # noqa: E402
from ds4quant.runtime.reference import torch_threads  # noqa: E402
from ds4quant.runtime.stream import Observer, SourceWeights, StreamedModel, plan_memory, stream_forward  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
CHILD = Path(__file__).with_name("_budget_child.py")
BUDGET = 800 << 20


@pytest.fixture(scope="module")
def flash_mini(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "samples"))
    try:
        from make_synthetic import make_synthetic, preset
    finally:
        sys.path.pop(0)
    out = tmp_path_factory.mktemp("flash") / "mini"
    make_synthetic(out, preset("ds4-flash-mini", layers=6, experts=64))
    return out


def _float_bytes(w) -> int:
    return sum(w.layer_bytes(L) for L in range(w.n_layers)) + w.global_bytes("embed") + w.global_bytes("head")


def test_runs_within_a_budget_its_float_weights_exceed(flash_mini, tmp_path):
    with SourceWeights(flash_mini) as w:
        assert _float_bytes(w) > BUDGET * 1.15
    # an unbounded run here gives the same logits (the budget changes where things live, never bits)
    rng = np.random.default_rng(1)
    sums = []

    class Keep(Observer):
        def on_logits(self, index, batch, logits):
            sums.append(float(logits.double().sum()))

    with SourceWeights(flash_mini) as w, torch_threads(1):
        sm = StreamedModel(w)
        seqs = [[int(t) for t in rng.integers(3, w.config.vocab_size, 64)] for _ in range(4)]
        stream_forward(sm, sm.batches(seqs), observer=Keep(), keep_logits=False)
    # the unbounded run came first: numba's kernels are compiled and cached on disk by
    # now, so the child's peak is the streamed run's, not a first compile's (a fresh
    # checkout compiles them once, in whichever process runs first)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(CHILD), str(flash_mini), str(BUDGET), str(tmp_path / "work")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["peak_rss"] - got["base_rss"] <= BUDGET, got
    assert got["plan"]["peak_bytes"] <= BUDGET
    assert sums == got["sums"]


def test_budget_below_one_layer_is_refused(flash_mini):
    with SourceWeights(flash_mini) as w:
        with pytest.raises(BudgetError, match=r"layer 0 needs 0\.[0-9]+ GiB .* more than --max-memory 0\.50 GiB"):
            plan_memory(w, [(1, 64)] * 4, "512M")
        one = plan_memory(w, [(1, 64)] * 4, "1G")
        assert one.store_kind == "ram" and one.expert_cache is None
        # hidden states larger than the budget leave the largest layer: a memmap, bounded expert cache
        big = plan_memory(w, [(1, 512)] * 256, "1200M")
        assert big.hidden_bytes >= 1 << 30 and big.store_kind == "memmap"
        with pytest.raises(BudgetError, match="need a work folder"):
            big.make_store(None)
        tight = plan_memory(w, [(1, 64)] * 4, "600M")
        assert tight.expert_cache is not None and tight.expert_cache < tight.all_experts_bytes[0]
        with pytest.raises(BadInputError, match="size must be positive"):
            plan_memory(w, [(1, 64)], "-1G")


def test_what_the_caller_keeps_is_counted(flash_mini):
    """calibrate's statistics live beside the stream for the whole run: a budget that fits
    the stream alone is refused once they are counted, and the plan's peak includes them."""
    from ds4quant.calibrate.collect import statistics_bytes
    from ds4quant.calibrate.model import open_stream

    with SourceWeights(flash_mini) as w:
        stats = statistics_bytes(w.config)
        c = w.config
        assert stats >= 2 * c.num_hidden_layers * c.n_routed_experts * (c.hidden_size + c.moe_intermediate_size) * 8
        alone = plan_memory(w, [(1, 64)] * 4, "1G")
        kept = plan_memory(w, [(1, 64)] * 4, "1G", reserved=stats)
        assert kept.peak_bytes == alone.peak_bytes + stats or kept.expert_cache != alone.expert_cache
        assert kept.reserved_bytes == stats and kept.to_json()["reserved_bytes"] == stats
        fits = alone.peak_bytes + (8 << 20)
        with pytest.raises(BudgetError, match="layer 0 needs"):
            plan_memory(w, [(1, 64)] * 4, fits, reserved=fits)
    from ds4quant.sources import open_official_source

    src = open_official_source(flash_mini, "test")
    try:
        cfg = src.config
    finally:
        src.close()
    assert open_stream(flash_mini, cfg, [64] * 4, "cpu", "1G").plan.reserved_bytes == stats


def test_a_gpu_layer_keeps_its_experts_on_the_gpu(flash_mini):
    """On a CUDA device the decoded experts live in GPU memory (FP4 ones as bfloat16):
    their bound comes from the GPU's free bytes, the host budget no longer pays for
    them, and a layer the GPU cannot hold falls back to the CPU with the host's bound.
    (The plan needs no GPU: it is handed the free bytes.)"""
    with SourceWeights(flash_mini) as w:
        assert all(w.experts_fp4(L) for L in range(w.n_layers))
        shapes = [(1, 64)] * 4
        host = plan_memory(w, shapes, "600M")
        assert host.expert_cache is not None  # the host alone cannot keep a layer's experts
        roomy = plan_memory(w, shapes, "600M", device="cuda:0", gpu_free=8 << 30)
        assert set(roomy.layer_devices) == {"cuda:0"} and roomy.gpu_expert_cache is None
        # (the host bound no longer pays for a working set the GPU holds)
        assert roomy.expert_cache_for("cuda:0") is None and roomy.expert_cache_for("cpu") >= host.expert_cache
        assert roomy.peak_bytes < host.peak_bytes  # the host holds one expert in transit, not a cache
        all_bf16 = roomy.all_experts_bytes[0] // 2
        small = max(roomy.layer_bytes) + roomy.working_bytes + 2 * roomy.batch_hidden_bytes
        tight = plan_memory(w, shapes, "600M", device="cuda:0", gpu_free=small + all_bf16)
        assert tight.gpu_expert_cache is not None and 0 < tight.gpu_expert_cache < all_bf16
        assert tight.to_json()["gpu_expert_cache"] == tight.gpu_expert_cache
        none = plan_memory(w, shapes, "600M", device="cuda:0", gpu_free=small // 2)
        assert set(none.layer_devices) == {"cpu"} and none.peak_bytes == host.peak_bytes


def test_a_gpu_layers_working_set_is_not_charged_to_the_host(flash_mini):
    """A layer on the GPU has its attention scores there: a host budget too small for a
    batch's working set refuses the CPU run but not the GPU one, and a GPU too small for
    the layer sends it back to the CPU, whose budget then pays for the working set."""
    from ds4quant.runtime.stream.memory import PROCESS_BYTES, working_bytes

    with SourceWeights(flash_mini) as w:
        shapes = [(8, 256)]
        work = working_bytes(w.config, 8, 256)
        free = plan_memory(w, shapes)  # no budget: the sizes
        need = PROCESS_BYTES + 2 * free.batch_hidden_bytes + max(max(free.layer_bytes), free.global_bytes)
        budget = need + work - 1
        with pytest.raises(BudgetError, match="needs"):
            plan_memory(w, shapes, budget)
        gpu = plan_memory(w, shapes, budget, device="cuda:0", gpu_free=64 << 30)
        assert set(gpu.layer_devices) == {"cuda:0"} and gpu.working_bytes == work
        assert gpu.peak_bytes <= budget
        with pytest.raises(BudgetError, match="needs"):
            plan_memory(w, shapes, budget, device="cuda:0", gpu_free=1 << 20)
