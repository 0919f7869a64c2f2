"""DS4 GGUF conventions (docs/formats.md#ds4-gguf)."""

from __future__ import annotations

import pytest

from ds4quant.artifact import (
    REQUIRED_U32_KEYS,
    GGUFWriter,
    check_ds4_header,
    expert_shape,
    read_gguf,
)
from ds4quant.names import DS4_U32_KEYS, LOADER_U32_KEYS, WRITTEN_U32_KEYS, Proj, parse_stack, stack_name
from ds4quant.errors import BadInputError


def test_required_keys_match_the_loader_list():
    assert len(REQUIRED_U32_KEYS) == 21 and len(set(REQUIRED_U32_KEYS)) == 21
    assert "deepseek4.attention.indexer.top_k" in REQUIRED_U32_KEYS
    assert "deepseek4.hyper_connection.sinkhorn_iterations" in REQUIRED_U32_KEYS


def test_one_header_table_says_what_is_written_and_what_the_loader_requires():
    from ds4quant.sources.naming import REQUIRED_U32_KEYS as WRITTEN_BY_CONVERT

    assert REQUIRED_U32_KEYS == LOADER_U32_KEYS and WRITTEN_BY_CONVERT == WRITTEN_U32_KEYS
    assert [k for k, req in DS4_U32_KEYS if not req] == ["deepseek4.attention.value_length"]
    assert set(LOADER_U32_KEYS) < set(WRITTEN_U32_KEYS)


def test_header_check_lists_every_problem(tmp_path):
    w = GGUFWriter(tmp_path / "d.gguf")
    w.add_string("general.architecture", "deepseek4")
    for k in REQUIRED_U32_KEYS[2:]:
        w.add_uint32(k, 1)
    w.add_int32(REQUIRED_U32_KEYS[1], 4096)  # wrong type
    w.write()
    problems = check_ds4_header(read_gguf(tmp_path / "d.gguf").kv)
    assert problems == [f"{REQUIRED_U32_KEYS[0]} is missing", f"{REQUIRED_U32_KEYS[1]} must be UINT32, got INT32"]

    w = GGUFWriter(tmp_path / "ok.gguf")
    w.add_string("general.architecture", "deepseek4")
    for k in REQUIRED_U32_KEYS:
        w.add_uint32(k, 1)
    w.write()
    assert check_ds4_header(read_gguf(tmp_path / "ok.gguf").kv) == []
    assert check_ds4_header({})[0] == "general.architecture is missing"


def test_expert_names_and_shapes():
    assert stack_name(42, "down") == "blk.42.ffn_down_exps.weight"
    assert parse_stack("blk.42.ffn_down_exps.weight") == (42, Proj.DOWN, None)
    assert parse_stack("blk.0.ffn_gate_up_exps.weight") is None  # DS4 has no fused gate_up
    assert parse_stack("blk.1.ffn_down_shexp.weight") is None
    assert expert_shape("gate", 4096, 2048, 256) == (4096, 2048, 256)
    assert expert_shape("down", 4096, 2048, 256) == (2048, 4096, 256)
    with pytest.raises(BadInputError):
        stack_name(0, "gate_up")
