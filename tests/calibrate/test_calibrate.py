"""calibrate: imatrix and routing profile from the transformers reference model.

Runs on a tiny official-layout fp32 checkpoint built here (the tiny
config of docs/reference-model.md#tiny-models), so the tests do not depend on samples/.
The checkpoint is rigged so that some experts can never be reached: hash
layers 0-1 never name expert 15 in tid2eid, and layer 3's router bias keeps
expert 15 out of every top-k. Layer 2's expert weights are scaled up so the
SwiGLU clamp (10) is active in the hand computation.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from ds4quant.calib.imatrix import importance_for, read_imatrix  # noqa: E402
from ds4quant.calib.routing import read_routing_csv, read_routing_json  # noqa: E402
from ds4quant.calibrate import calibrate, read_tokens  # noqa: E402
from ds4quant.cli import cli  # noqa: E402
from ds4quant.errors import BadInputError  # noqa: E402
from ds4quant.runtime.reference import expert_rows  # noqa: E402

TINY = {
    "vocab_size": 512, "hidden_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "q_lora_rank": 128,
    "partial_rotary_factor": 0.25,
    "num_experts_per_tok": 4, "n_routed_experts": 16, "n_shared_experts": 1,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "sliding_window": 16, "hc_mult": 2, "hc_sinkhorn_iters": 20,
    "o_groups": 2, "o_lora_rank": 64,
    "index_n_heads": 4, "index_head_dim": 32, "index_topk": 4,
    "max_position_embeddings": 4096, "num_nextn_predict_layers": 0,
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
}
N_LAYER, N_EXPERT, K, HIDDEN, INTER = 4, 16, 4, 256, 128
HASH_LAYERS = (0, 1)
SEQ_LENS = (24, 17, 31)
FORCED_UNREACHED = {0: 15, 1: 15, 3: 15}


def _official_name(hf: str) -> str:
    # transformers -> official names: the table in docs/reference-model.md#names, as
    # ds4quant.sources.naming holds it (official -> transformers), reversed.
    from ds4quant.sources.naming import _HF_GLOBAL, _HF_LAYER

    rev = {v: k for k, v in _HF_GLOBAL.items()}
    if hf in rev:
        return rev[hf]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
    layer, rest = m.groups()
    for official, hf_prefix in _HF_LAYER:
        if rest.startswith(hf_prefix):
            return f"layers.{layer}.{official}{rest[len(hf_prefix):]}"
    raise KeyError(hf)


def _make_checkpoint(d: Path) -> None:
    from safetensors.torch import save_file
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(**TINY)
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg)
    out = {}
    for name, t in model.state_dict().items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name)
        if m:
            layer = int(m.group(1))
            for e in range(N_EXPERT):
                if m.group(2) == "down_proj":
                    out[f"layers.{layer}.ffn.experts.{e}.w2.weight"] = t[e].clone()
                    continue
                scale = 50.0 if layer == 2 else 1.0  # gate/up beyond +-10: the clamp matters
                out[f"layers.{layer}.ffn.experts.{e}.w1.weight"] = (t[e, :INTER] * scale).contiguous()
                out[f"layers.{layer}.ffn.experts.{e}.w3.weight"] = (t[e, INTER:] * scale).contiguous()
            continue
        out[_official_name(name)] = t.clone().contiguous()
    rng = np.random.default_rng(1234)
    for layer in HASH_LAYERS:  # tid2eid is zero-initialised: 4 distinct experts of 0..14 per token
        table = np.stack([rng.choice(N_EXPERT - 1, K, replace=False) for _ in range(TINY["vocab_size"])])
        out[f"layers.{layer}.ffn.gate.tid2eid"] = torch.from_numpy(table.astype(np.int64))
    bias = torch.zeros(N_EXPERT)
    bias[15] = -1e4
    out["layers.3.ffn.gate.bias"] = bias
    save_file(out, str(d / "model.safetensors"))
    cfg.save_pretrained(d)


def _sequences():
    rng = np.random.default_rng(7)
    return [[0] + rng.integers(3, TINY["vocab_size"], n - 1).tolist() for n in SEQ_LENS]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ds4-fixture")
    _make_checkpoint(d)
    return d


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("tok") / "tokens.txt"
    p.write_text("# calibration tokens\n" + "\n".join(" ".join(map(str, s)) for s in _sequences()) + "\n")
    return p


@pytest.fixture(scope="module")
def run1(ckpt, tokens_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("calib") / "out"
    seen = []
    rep = calibrate(ckpt, tokens_file, out,
                    progress=lambda ev: seen.append((ev.done, ev.total, ev.detail["tokens"]))
                    if ev.kind.value == "step" else None)
    return rep, out, seen


@pytest.fixture(scope="module")
def reference(ckpt):
    """The model's own view, captured independently: per layer and sequence the
    experts' call (hidden, top_k_index, weights, output) and the router's choices."""
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, experts_implementation="eager")
    model.eval()
    calls = {layer: [] for layer in range(N_LAYER)}
    router = {layer: [] for layer in range(N_LAYER)}
    for layer_idx, layer in enumerate(model.model.layers):
        layer.mlp.experts.register_forward_hook(
            lambda mod, args, out, i=layer_idx: calls[i].append((args[0].clone(), args[1].clone(), args[2].clone(),
                                                                 out.clone())))
        layer.mlp.gate.register_forward_hook(lambda mod, args, out, i=layer_idx: router[i].append(out[2].clone()))
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for s in _sequences():
                model(input_ids=torch.tensor([s]), use_cache=False)
    finally:
        torch.set_num_threads(old)
    return model, calls, router


def _weights(ckpt: Path, layer: int, e: int):
    from safetensors.numpy import load_file

    sd = load_file(str(ckpt / "model.safetensors"))
    get = lambda w: sd[f"layers.{layer}.ffn.experts.{e}.{w}.weight"].astype(np.float64)  # noqa: E731
    return get("w1"), get("w3"), sd


# --------------------------------------------------------------------------


def test_outputs_and_report(run1):
    rep, out, seen = run1
    assert sorted(p.name for p in out.iterdir()) == ["imatrix.gguf", "imatrix.lucebox.dat", "report.json", "routing.csv",
                                                      "routing.json", "sensitivity.json"]
    assert read_imatrix(out / "imatrix.lucebox.dat").format == "lucebox"
    doc = json.loads((out / "report.json").read_text())
    assert doc["schema"] == "ds4quant.calibration_report" and doc["version"] == 1
    assert doc["tokens"]["sequences"] == 3 and doc["tokens"]["tokens"] == sum(SEQ_LENS)
    assert doc["tokens"]["file"] == "tokens.txt"
    assert doc["model"]["hash_layers"] == [0, 1]
    assert set(doc["run"]) == {"seconds", "device", "resumed_at"} and doc["run"]["device"] == "cpu"
    assert doc == rep.to_json()
    assert (rep.sequences, rep.tokens) == (3, sum(SEQ_LENS))
    # progress after every layer and the head: (done, total, tokens through the layers so far)
    assert seen == [(i, N_LAYER + 1, i * sum(SEQ_LENS)) for i in range(1, N_LAYER + 2)]
    im = read_imatrix(out / "imatrix.gguf")
    assert im.chunk_count == 3 and im.chunk_size is None  # ragged sequences
    assert im.datasets == ("tokens.txt",)


def test_expert_imatrix_equals_hand_computation(run1, reference, ckpt):
    """E[x^2] per column for one expert, from the model's captured inputs and a
    float64 SwiGLU on the checkpoint's own w1/w3 (independent of calibrate)."""
    rep, out, _ = run1
    _model, calls, _ = reference
    im = read_imatrix(out / "imatrix.gguf")
    for layer in (0, 2):  # a hash-routed and a score-routed layer
        rows = [[] for _ in range(N_EXPERT)]
        for hidden, idx, _w, _o in calls[layer]:
            for e in range(N_EXPERT):
                tok = np.nonzero((idx.numpy() == e).any(axis=1))[0]
                rows[e].append(hidden.numpy()[tok].astype(np.float64))
        e = int(np.argmax([sum(len(r) for r in rs) for rs in rows]))
        x = np.concatenate(rows[e])
        w1, w3, _ = _weights(ckpt, layer, e)
        gate, up = x @ w1.T, x @ w3.T
        if layer == 2:
            assert (gate > 10).any() and (np.abs(up) > 10).any()  # the clamp is exercised
        g = np.minimum(gate, 10.0)
        act = g / (1.0 + np.exp(-g)) * np.clip(up, -10.0, 10.0)
        q_in = importance_for(im, f"blk.{layer}.ffn_gate_exps.weight", expert=e, cols=HIDDEN)
        np.testing.assert_allclose(q_in, (x * x).mean(axis=0), rtol=1e-6)
        assert np.array_equal(q_in, importance_for(im, f"blk.{layer}.ffn_up_exps.weight", expert=e))
        q_down = importance_for(im, f"blk.{layer}.ffn_down_exps.weight", expert=e, cols=INTER)
        np.testing.assert_allclose(q_down, (act * act).mean(axis=0), rtol=1e-5)
        entry = im.entries[f"blk.{layer}.ffn_down_exps.weight"]
        assert entry.values.shape == (N_EXPERT, INTER) and entry.counts[e] == len(x)


def test_down_input_is_the_models_own_activation(reference):
    """expert_rows rebuilds the eager experts output bit for bit, so the down
    surface's x^2 is taken from exactly what the model multiplied."""
    model, calls, _ = reference
    import torch.nn.functional as F

    for layer in (1, 2):
        experts = model.model.layers[layer].mlp.experts
        hidden, idx, w, expected = calls[layer][0]
        final = torch.zeros_like(hidden)
        old = torch.get_num_threads()
        torch.set_num_threads(1)  # as the capture ran (bits depend on the thread count)
        try:
            with torch.no_grad():
                for e in torch.unique(idx).tolist():
                    pos, tok, _x, act = expert_rows(experts, hidden, idx.transpose(0, 1), e)
                    final.index_add_(0, tok, F.linear(act, experts.down_proj[e]) * w[tok, pos, None])
        finally:
            torch.set_num_threads(old)
        assert torch.equal(final, expected)


def test_counts_and_routing_match_the_router(run1, reference, ckpt):
    rep, out, _ = run1
    _model, _calls, router = reference
    prof = read_routing_json(out / "routing.json")
    assert prof.tokens == sum(SEQ_LENS) and prof.n_expert_used == K
    assert prof.layer_totals().tolist() == [sum(SEQ_LENS) * K] * N_LAYER
    want = np.stack([np.bincount(torch.cat(router[layer]).reshape(-1).numpy(), minlength=N_EXPERT)
                     for layer in range(N_LAYER)])
    assert prof.counts.tolist() == want.tolist()
    # hash layers: straight from the checkpoint's tid2eid table
    from safetensors.numpy import load_file

    sd = load_file(str(ckpt / "model.safetensors"))
    ids = np.concatenate([np.array(s) for s in _sequences()])
    for layer in HASH_LAYERS:
        table = sd[f"layers.{layer}.ffn.gate.tid2eid"]
        assert prof.counts[layer].tolist() == np.bincount(table[ids].reshape(-1), minlength=N_EXPERT).tolist()
    # the CSV carries the same counts; the imatrix counts per expert are the slots
    csv = read_routing_csv(out / "routing.csv")
    assert np.array_equal(csv.counts, prof.counts) and csv.n_expert_used == K
    im = read_imatrix(out / "imatrix.gguf")
    for layer in range(N_LAYER):
        for s in ("gate", "up", "down"):
            assert im.entries[f"blk.{layer}.ffn_{s}_exps.weight"].counts.tolist() == prof.counts[layer].tolist()


def test_unreached_experts_have_count_zero_and_are_listed(run1):
    rep, out, _ = run1
    im = read_imatrix(out / "imatrix.gguf")
    prof = read_routing_json(out / "routing.json")
    doc = json.loads((out / "report.json").read_text())
    for layer in range(N_LAYER):
        never = prof.unreached(layer)
        if layer in FORCED_UNREACHED:
            assert FORCED_UNREACHED[layer] in never
        for s in ("gate", "up", "down"):
            name = f"blk.{layer}.ffn_{s}_exps.weight"
            assert rep.unreached[name] == never and doc["unreached_experts"][name] == list(never)
            for e in never:
                assert importance_for(im, name, expert=e) is None  # converter falls back to weight-only
                assert not im.entries[name].values[e].any()
    assert doc["unreached_count"] == sum(len(prof.unreached(layer)) for layer in range(N_LAYER)) >= 3


def test_dense_entries_use_source_gguf_names(run1, ckpt):
    from ds4quant.sources import map_names, open_source

    rep, out, _ = run1
    with open_source(ckpt) as src:
        gguf = set(map_names(src.tensor_names()).by_gguf())
    assert rep.dense_tensors and set(rep.dense_tensors) <= gguf
    im = read_imatrix(out / "imatrix.gguf")
    for layer in range(N_LAYER):
        for stem in ("attn_q_a", "attn_kv", "attn_q_b", "attn_output_b", "ffn_gate_shexp", "ffn_down_shexp"):
            assert im.entries[f"blk.{layer}.{stem}.weight"].counts[0] > 0
    # attn_output_a is grouped (o_groups=2): one input row per token and group
    assert im.entries["blk.0.attn_output_a.weight"].counts[0] == 2 * sum(SEQ_LENS)
    # the shared expert reads the same hidden rows as the routed experts: every
    # token reaches k routed experts, so sum_e sum_in[e] = k * sum_shared
    for layer in range(N_LAYER):
        routed = im.entries[f"blk.{layer}.ffn_gate_exps.weight"].values.astype(np.float64).sum(axis=0)
        shared = im.entries[f"blk.{layer}.ffn_gate_shexp.weight"]
        assert shared.counts[0] == sum(SEQ_LENS)
        np.testing.assert_allclose(routed, K * shared.values.astype(np.float64), rtol=1e-5)


def test_cli_json_run_is_byte_identical(run1, ckpt, tokens_file, tmp_path):
    """A second run (through the CLI) writes the same imatrix and routing bytes;
    report.json differs only in its run block."""
    _rep, out1, _ = run1
    out2 = tmp_path / "again"
    res = CliRunner().invoke(cli, ["calibrate", str(ckpt), "--tokens", str(tokens_file), "--out", str(out2), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    for name in ("imatrix.gguf", "imatrix.lucebox.dat", "routing.csv", "routing.json"):
        assert (out1 / name).read_bytes() == (out2 / name).read_bytes(), name
    d1 = json.loads((out1 / "report.json").read_text())
    d2 = json.loads((out2 / "report.json").read_text())
    d1.pop("run"), d2.pop("run"), doc.pop("run")
    assert d1 == d2 == doc


# --------------------------------------------------------------------------
# token input


@pytest.mark.parametrize(
    "text, needle",
    [
        ("1 2 3\n4 x 6\n", "line 2: token 'x' is not a token id"),
        ("1 2 3\n4 -5 6\n", "line 2: token '-5'"),
        ("1 2 3.0\n", "line 1: token '3.0'"),
        ("# c\n1 2 512\n", "line 2: token id 512 is out of range for vocab_size 512"),
        ("# only a comment\n\n", "holds no token sequences"),
        ("[[1, 2], [3, true]]", "sequence 1: item 1 is True"),
        ("[[1, 2], []]", "sequence 1: empty sequence"),
        ("[[1, 2], 3]", "sequence 1 is int"),
        ("[[1, 2], [3, 999]]", "sequence 1: token id 999 is out of range"),
        ("[[1, 2]", "not valid JSON"),
    ],
)
def test_cli_bad_token_file_is_one_line_exit_2(ckpt, tmp_path, text, needle):
    bad = tmp_path / "bad.tok"
    bad.write_text(text)
    res = CliRunner().invoke(cli, ["calibrate", str(ckpt), "--tokens", str(bad), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds4quant: error: ")
    assert str(bad) in lines[0] and needle in lines[0]
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_read_tokens_forms(tmp_path):
    p = tmp_path / "t.json"
    p.write_text("[[0, 5, 7], [511]]")
    assert read_tokens(p, 512) == ((0, 5, 7), (511,))
    p.write_text("# x\n0 5\t7\n\n  511  \n")
    assert read_tokens(p, 512) == ((0, 5, 7), (511,))
    with pytest.raises(BadInputError, match="exceed the model's max_position_embeddings 2"):
        read_tokens(p, 512, max_len=2)
    with pytest.raises(BadInputError, match="cannot read token file"):
        read_tokens(tmp_path / "missing.txt", 512)


def test_bad_arguments_refused(ckpt, tokens_file, tmp_path):
    with pytest.raises(BadInputError, match="sensitivity_seqs must be an int >= 0"):
        calibrate(ckpt, tokens_file, tmp_path / "o", sensitivity_seqs=-1)
    with pytest.raises(BadInputError, match="parent folder"):
        calibrate(ckpt, tokens_file, tmp_path / "a" / "b")
    with pytest.raises(BadInputError, match="no such folder"):
        calibrate(tmp_path / "nope", tokens_file, tmp_path / "o")
    with pytest.raises(BadInputError, match="sequence 0: token id 600"):
        calibrate(ckpt, [[1, 600]], tmp_path / "o")


# --------------------------------------------------------------------------
# the shipped sample (samples/ds4-tiny-calib, made by samples/ds4-tiny-calib/README.md)

SAMPLES = Path(__file__).resolve().parents[2] / "samples"


@pytest.mark.skipif(not (SAMPLES / "ds4-tiny-calib" / "routing.csv").exists(), reason="samples/ds4-tiny-calib absent")
def test_shipped_sample_calibration_regenerates(tmp_path):
    ship = SAMPLES / "ds4-tiny-calib"
    rep = calibrate(SAMPLES / "ds4-tiny", SAMPLES / "tokens.txt", tmp_path / "c")
    # Routing is integer top-k: exact. The float sums match the shipped file
    # bit for bit on the machine that made it; elsewhere BLAS may differ in the last bits.
    assert (tmp_path / "c" / "routing.csv").read_bytes() == (ship / "routing.csv").read_bytes()
    assert (tmp_path / "c" / "routing.json").read_bytes() == (ship / "routing.json").read_bytes()
    new, old = read_imatrix(tmp_path / "c" / "imatrix.gguf"), read_imatrix(ship / "imatrix.gguf")
    assert new.names == old.names
    for name in new.names:
        np.testing.assert_allclose(new.entries[name].values, old.entries[name].values, rtol=1e-5, err_msg=name)
        assert np.array_equal(new.entries[name].counts, old.entries[name].counts)
    shipped = json.loads((ship / "report.json").read_text())
    shipped.pop("run")
    now = rep.to_json()
    now.pop("run")
    for key in ("source", "tokens", "model", "unreached_experts", "dense_tensors"):
        assert now[key] == shipped[key], key
