"""DecodeTableRegistry: Lucebox compact-MIX registration rules, per-owner keys."""

from __future__ import annotations

import numpy as np
import pytest

from ds4quant.codebooks import CodebookEntry
from ds4quant.errors import CodebookError, UnregisteredTableError
from ds4quant.runtime.owners.base import ExpertStack
from ds4quant.runtime.registry import DecodeTableRegistry

T = "blk.2.ffn_down_exps.rocmfp3_mix.weight"


def _entry(ids=(1, 3, 5, 8), name=T, qtype="rocmfp3_mix", n_global=16):
    n = len(ids)
    base = np.array([-1, -0.75, -0.5, -0.25, 0.25, 0.5, 0.75, 1], np.float32)
    books = np.stack([np.stack([base * (0.5 + 0.0625 * i), base]) for i in range(n)]).astype(np.float32)
    modes = np.array([i % 2 for i in range(n)], np.uint8)
    return CodebookEntry(name, qtype, modes, books, expert_ids=tuple(ids), n_global=n_global)


def _stack(ids=(3, 8), tensor=T, qtype="rocmfp3_mix"):
    return ExpertStack(tensor, 2, "down", qtype, 4, 32, tuple(ids), np.zeros((len(ids), 4, 14), np.uint8))


def test_exact_cover_gathers_from_the_entry_order():
    reg = DecodeTableRegistry("cpu:0")
    e = _entry()
    reg.register(T, _stack(), (3, 8), e)
    books, modes = reg.lookup("cpu:0", T)
    assert np.array_equal(books, e.books[[1, 3]]) and np.array_equal(modes, e.modes[[1, 3]])
    assert reg.registered() == (T,)


def test_duplicate_id_is_refused():
    reg = DecodeTableRegistry("cpu:0")
    with pytest.raises(CodebookError, match=r"duplicate expert ids \[3\]") as ex:
        reg.register(T, _stack((3, 8)), (3, 3), _entry())
    assert T in str(ex.value)


def test_gap_is_refused():
    reg = DecodeTableRegistry("cpu:0")
    with pytest.raises(CodebookError, match=r"missing \[8\]"):
        reg.register(T, _stack((3, 8)), (3,), _entry())


def test_unknown_id_is_refused():
    reg = DecodeTableRegistry("cpu:0")
    with pytest.raises(CodebookError, match=r"no books for expert ids \[4\]"):
        reg.register(T, _stack((3, 4)), (3, 4), _entry())
    with pytest.raises(CodebookError, match="not resident"):
        reg.register(T, _stack((3, 8)), (3, 5), _entry())
    assert reg.registered() == ()


def test_null_tensor_with_empty_ids_succeeds_and_registers_nothing():
    reg = DecodeTableRegistry("cpu:0")
    reg.register(T, None, (), _entry())
    assert reg.registered() == ()
    with pytest.raises(UnregisteredTableError):
        reg.lookup("cpu:0", T)


def test_ids_without_tensor_and_tensor_without_ids_fail():
    reg = DecodeTableRegistry("cpu:0")
    with pytest.raises(CodebookError, match=r"given for no resident tensor"):
        reg.register(T, None, (3, 8), _entry())
    with pytest.raises(CodebookError, match="needs its expert ids"):
        reg.register(T, _stack(), (), _entry())


def test_qtype_and_name_must_match_the_entry():
    reg = DecodeTableRegistry("cpu:0")
    with pytest.raises(CodebookError, match="differs from the tensor"):
        reg.register(T, _stack(), (3, 8), CodebookEntry(
            T, "rocmfp2_mix", np.ones(4, np.uint8), np.tile(np.array([-1, -0.5, 0.5, 1], np.float32), (4, 2, 1)),
            expert_ids=(1, 3, 5, 8), n_global=16))
    with pytest.raises(CodebookError, match="entry is for tensor"):
        reg.register(T, _stack(), (3, 8), _entry(name="blk.2.ffn_down_exps.weight"))
    with pytest.raises(CodebookError, match="takes no decode table"):
        reg.register(T, _stack(qtype="rocmfp3"), (3, 8), _entry())


def test_reregistration_replaces_and_unregister_removes():
    reg = DecodeTableRegistry("cpu:0")
    reg.register(T, _stack(), (3, 8), _entry())
    e2 = _entry(ids=(3, 8))
    reg.register(T, _stack(), (3, 8), e2)
    books, _ = reg.lookup("cpu:0", T)
    assert np.array_equal(books, e2.books)
    reg.unregister(T)
    with pytest.raises(UnregisteredTableError, match="no decode table is registered"):
        reg.lookup("cpu:0", T)
    with pytest.raises(UnregisteredTableError):
        reg.unregister(T)


def test_another_owners_identity_cannot_resolve_the_entry():
    a, b = DecodeTableRegistry("cpu:0"), DecodeTableRegistry("cpu:1")
    a.register(T, _stack(), (3, 8), _entry())
    with pytest.raises(UnregisteredTableError, match="belongs to owner 'cpu:0'"):
        a.lookup("cpu:1", T)
    with pytest.raises(UnregisteredTableError):
        b.lookup("cpu:0", T)
    with pytest.raises(UnregisteredTableError):
        b.lookup("cpu:1", T)


def test_tables_are_read_only():
    reg = DecodeTableRegistry("cpu:0")
    reg.register(T, _stack(), (3, 8), _entry())
    books, modes = reg.lookup("cpu:0", T)
    with pytest.raises(ValueError):
        books[0, 0, 0] = 0.0
