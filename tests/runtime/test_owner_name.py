"""Owner names (runtime/owners/kinds.py): one parser, one owner-kind registry; and the Mode enum."""

from __future__ import annotations

import pickle

import pytest

from ds4quant.errors import BadInputError
from ds4quant.runtime import Mode, OwnerKind, OwnerName
from ds4quant.runtime.owners.kinds import FACTORIES, make_owner, owner_factory

K = OwnerKind

# every form of the contract: text -> (kind, index, hosted text, runtime identity)
FORMS = {
    "cpu": (K.CPU, None, None, "cpu:0"),
    "cpu:0": (K.CPU, 0, None, "cpu:0"),
    "cpu:12": (K.CPU, 12, None, "cpu:12"),
    "torch-cpu:3": (K.TORCH_CPU, 3, None, "torch-cpu:3"),
    "cuda:0": (K.CUDA, 0, None, "cuda:0"),
    "hip:7": (K.HIP, 7, None, "hip:7"),
    "worker:0": (K.WORKER, 0, None, "worker:0"),
    "worker:9999": (K.WORKER, 9999, None, "worker:9999"),
    "worker:1/cpu": (K.WORKER_HOSTED, 1, "cpu", "worker:1/cpu"),
    "worker:1/cpu:2": (K.WORKER_HOSTED, 1, "cpu:2", "worker:1/cpu:2"),
    "worker:0/torch-cpu:0": (K.WORKER_HOSTED, 0, "torch-cpu:0", "worker:0/torch-cpu:0"),
    "worker:2/cuda:1": (K.WORKER_HOSTED, 2, "cuda:1", "worker:2/cuda:1"),
    "worker:3/hip:0": (K.WORKER_HOSTED, 3, "hip:0", "worker:3/hip:0"),
}


@pytest.mark.parametrize("text", list(FORMS))
def test_every_owner_name_form_parses_and_spells_itself_back(text):
    kind, index, hosted, identity = FORMS[text]
    name = OwnerName.parse(text)
    assert (name.kind, name.index, name.identity, str(name)) == (kind, index, identity, text)
    assert (None if name.hosted is None else str(name.hosted)) == hosted
    assert OwnerName.parse(name) is name and OwnerName.parse(str(name)) == name
    assert pickle.loads(pickle.dumps(name)) == name  # crosses to a worker or a rank as is
    assert name.kind.hostable == (kind not in (K.WORKER, K.WORKER_HOSTED))


REFUSED = ["", "gpu", "gpu7", "zz:1", "none", "CPU", "cpu:", "cpu:-1", "cpu:01", "cpu:00", "cpu:12345", "cpu:1.0",
           "cpu:１", "cuda", "hip", "torch-cpu", "torch-cpu:x", "worker", "worker:", "worker:00/cpu", "worker:0/",
           "worker:0/worker:1", "worker:0/gpu:0", "worker:1/cuda", "cpu:0/cuda:0", "worker:0/cpu/cpu", " cpu",
           "cpu:0 ", "cuda:0\n", None, 3, b"cpu", ("cpu",)]


@pytest.mark.parametrize("text", REFUSED, ids=[repr(t) for t in REFUSED])
def test_anything_else_is_one_line_naming_it(text):
    with pytest.raises(BadInputError) as ei:
        OwnerName.parse(text, where="--owner")
    msg = ei.value.one_line()
    assert "\n" not in msg and msg.startswith("--owner: unknown owner name ")
    assert repr(text).replace("\n", " ") in msg or repr(text) in str(ei.value)
    assert "worker:N/OWNER" in msg  # the forms it takes


def test_the_registry_names_a_factory_for_every_kind_and_make_owner_uses_it():
    assert set(FACTORIES) == set(OwnerKind)
    pytest.importorskip("torch")
    from ds4quant.runtime.owners import torch_owner

    assert owner_factory(K.TORCH_CPU) is torch_owner.owner_for
    o = make_owner("torch-cpu:2", swiglu_limit=7.0)
    try:
        assert isinstance(o, torch_owner.TorchOwner) and o.identity == "torch-cpu:2" and o.swiglu_limit == 7.0
        assert str(o.device) == "cpu"
    finally:
        o.close()
    o = make_owner(OwnerName.parse("torch-cpu:0"), identity="worker:0/torch-cpu:0")
    assert o.identity == "worker:0/torch-cpu:0"
    o.close()
    with pytest.raises(BadInputError, match="unknown owner name 'gpu:0'"):
        make_owner("gpu:0")


def test_the_worker_child_builds_its_owner_through_the_same_registry():
    pytest.importorskip("torch")
    from ds4quant.runtime.owners.torch_owner import TorchOwner
    from ds4quant.runtime.owners.worker import hosted_name, hosted_owner

    o = hosted_owner("torch-cpu:1", "worker:4/torch-cpu:1", {"swiglu_limit": 3.0})
    assert isinstance(o, TorchOwner) and o.identity == "worker:4/torch-cpu:1" and o.swiglu_limit == 3.0
    o.close()
    assert hosted_name("cuda:0").kind is K.CUDA
    assert hosted_name("tests.runtime._fake_owner:FakeOwner") is None  # a plug-in class path
    with pytest.raises(BadInputError, match="cannot be hosted by a worker process"):
        hosted_name("worker:1")


@pytest.mark.parametrize("text", ["exact", "fast", Mode.EXACT, Mode.FAST])
def test_mode_parses_its_names_and_passes_a_mode_through(text):
    m = Mode.parse(text)
    assert isinstance(m, Mode) and m.value == str(text) and m == str(text)
    assert Mode.parse(m) is m and str(m) == m.value


@pytest.mark.parametrize("bad", ["approx", "EXACT", "", None, 1, "exact "])
def test_an_unknown_mode_is_one_line(bad):
    with pytest.raises(BadInputError) as ei:
        Mode.parse(bad, where="--mode")
    assert ei.value.one_line() == f"--mode: unknown mode {bad!r}; expected exact or fast"
