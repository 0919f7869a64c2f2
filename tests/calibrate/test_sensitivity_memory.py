"""calibrate's memory plan counts the sensitivity pass: its captured experts
calls, probe deltas, noise and perturbed copies are reserved beside the
stream, on the host or the GPU where they live, so a budget that holds the
stream but not the pass is refused up front, naming the layer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from ds4quant.calibrate import calibrate  # noqa: E402
from ds4quant.calibrate.collect import statistics_bytes  # noqa: E402
from ds4quant.calibrate.model import open_stream  # noqa: E402
from ds4quant.calibrate.sensitivity import sensitivity_bytes  # noqa: E402
from ds4quant.cli import cli  # noqa: E402
from ds4quant.sources import open_official_source  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "ds4-tiny"


class _Flash:  # DeepSeek-V4 Flash's dimensions
    hidden_size, moe_intermediate_size, num_experts_per_tok, n_routed_experts = 4096, 2048, 6, 256


def test_the_pass_bytes_follow_the_method_and_the_device():
    gib = 1 << 30
    host, dev = sensitivity_bytes(_Flash, [2048] * 8, "streamed", "cpu")
    assert dev == 0 and 1.5 * gib < host < 2.5 * gib  # rows, probe deltas, one expert's noise, draws ahead
    g_host, g_dev = sensitivity_bytes(_Flash, [2048] * 8, "streamed", "cuda:0")
    assert g_host < host and g_dev > 0 and g_host + g_dev > host  # the GPU keeps its own draws further ahead
    # per-tensor keeps every expert's float64 noise of the three surfaces, on the host: 48 GiB here
    pt_host, pt_dev = sensitivity_bytes(_Flash, [2048] * 8, "per-tensor", "cuda:0")
    assert pt_host == 3 * 256 * 2048 * 4096 * 8 and pt_dev > 0
    assert sensitivity_bytes(_Flash, [], "streamed") == (0, 0)
    # the captured calls grow with the sensitivity tokens
    more, _ = sensitivity_bytes(_Flash, [2048] * 16, "streamed", "cpu")
    assert more - host == 8 * 2048 * (4 * 4096 + 12 * 6) + 2 * 8 * 2048 * 4096 * 4


def _tokens(tmp: Path) -> Path:
    vocab = json.loads((SAMPLE / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(2)
    p = tmp / "tokens.txt"
    p.write_text("\n".join(" ".join(map(str, [0] + rng.integers(3, vocab, 29).tolist())) for _ in range(3)) + "\n")
    return p


def test_a_budget_without_room_for_the_pass_is_refused_up_front(tmp_path):
    with open_official_source(SAMPLE, "test") as src:
        cfg = src.config
    toks = _tokens(tmp_path)
    bare = open_stream(SAMPLE, cfg, [30] * 3, "cpu")
    with_pass = open_stream(SAMPLE, cfg, [30] * 3, "cpu", split=2, sensitivity="streamed")
    from ds4quant.runtime.stream import SourceWeights

    with SourceWeights(SAMPLE) as w:
        host, _ = sensitivity_bytes(w.config, [30, 30], "streamed", "cpu")
        assert with_pass.plan.reserved_bytes == statistics_bytes(w.config) + host
    assert with_pass.plan.peak_bytes == bare.plan.peak_bytes + host
    # the least budget the stream alone runs in (one expert decoded at a time), and not a byte more
    from ds4quant.runtime.stream.memory import PROCESS_BYTES

    p = bare.plan
    least = (PROCESS_BYTES + p.reserved_bytes + p.working_bytes + 2 * p.batch_hidden_bytes
             + max(max(p.layer_bytes), p.global_bytes))
    budget = str(least + host - 1)
    res = CliRunner().invoke(cli, ["calibrate", str(SAMPLE), "--tokens", str(toks), "--out", str(tmp_path / "c"),
                                   "--sensitivity-seqs", "2", "--max-memory", budget])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
    assert "--max-memory: layer" in res.output and not (tmp_path / "c").exists()
    # the same budget holds the stream without the pass (fewer decoded experts kept)
    rep = calibrate(SAMPLE, toks, tmp_path / "ok", sensitivity_seqs=0, max_memory=budget)
    assert rep.tokens == 90
