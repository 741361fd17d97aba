"""Configuration mistakes in flowmoe.torch are ValueErrors that say what was wrong and what is
expected, raised up front, and no error message carries a C++ source location unless debugging is
on (flowmoe.set_debug). CPU only."""

import re
import warnings

import pytest
import torch

import flowmoe
import flowmoe._errors as errors
from flowmoe.torch import MoE, MoEExperts, experts

H, F, E, K = 128, 128, 4, 2
LOCATION = re.compile(r"\[(src|include|tools)/[^\]]*:\d+\]")


@pytest.fixture
def no_debug():
    old = errors.debug()
    flowmoe.set_debug(False)
    yield
    flowmoe.set_debug(old)


@pytest.mark.parametrize("args,match", [
    ((H, F, E, 0), r"topk = 0; expected a positive int"),
    ((H, F, E, 16), r"topk = 16 with experts = 4.*expected topk <= experts"),
    ((H, F, E, 33), r"topk = 33; expected at most 32"),
    ((H, F, 2000, 2), r"experts = 2000; expected at most 1024"),
    ((H, F, E, 2.0), r"topk = 2.0; expected a positive int"),
    ((H, 200, E, K), r"ffn = 200 is not a multiple of 128.*such as 128 or 256"),
])
def test_bad_sizes_are_value_errors_without_location(no_debug, args, match):
    for cls in (MoE, MoEExperts):
        with pytest.raises(ValueError, match=match) as info:
            cls(*args)
        assert isinstance(info.value, flowmoe.ConfigError)  # also a FlowmoeError
        assert not LOCATION.search(str(info.value)), str(info.value)


def test_hidden_not_multiple_of_128_names_the_padding_way_out(no_debug):
    with pytest.raises(ValueError) as info:
        MoE(100, F, E, K)
    msg = str(info.value)
    assert "hidden = 100 is not a multiple of 128" in msg and "such as 128" in msg
    assert "flowmoe.torch.experts" in msg and "flowmoe.hf" in msg


def test_the_padding_way_out_works_for_hidden_100():
    # what the message above promises: flowmoe.torch.experts takes H = 100, F = 72 as they are
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 100, generator=g).bfloat16()
    w1, w2 = torch.randn(E, 2 * 72, 100, generator=g) * 0.1, torch.randn(E, 100, 72, generator=g) * 0.1
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    y = experts(x, ids, torch.full((6, 2), 0.5), w1, w2, recipe="bf16")
    assert y.shape == (6, 100) and bool(torch.isfinite(y.float()).all())


def test_experts_function_checks_topk_against_experts(no_debug):
    x = torch.randn(4, H).bfloat16()
    w1, w2 = torch.randn(2, 2 * F, H), torch.randn(2, H, F)
    ids = torch.zeros(4, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="topk = 3 with experts = 2") as info:
        experts(x, ids, torch.ones(4, 3), w1, w2)
    assert not LOCATION.search(str(info.value))


def test_non_finite_weights_error_has_no_location_unless_debugging(no_debug):
    m = MoE(H, F, E, K, recipe="flow", seed=1)
    with torch.no_grad():
        m.w2[0, 3, 5] = float("nan")
    x = torch.randn(8, H).bfloat16()
    with pytest.raises(flowmoe.NonFiniteError, match="non-finite") as info:
        m(x)
    e = info.value
    assert isinstance(e, ValueError)
    assert not LOCATION.search(str(e)), str(e)
    assert e.location and re.fullmatch(r"src/\S+:\d+", e.location)  # kept for developers
    flowmoe.set_debug(True)
    m2 = MoE(H, F, E, K, recipe="flow", seed=1)
    with torch.no_grad():
        m2.w2[0, 3, 5] = float("nan")
    with pytest.raises(flowmoe.NonFiniteError) as info:
        m2(x)
    assert LOCATION.search(str(info.value)), str(info.value)


def test_split_location():
    text, loc = errors.split_location("MoeConfig: bad [src/common/moe_common.cpp:119]")
    assert (text, loc) == ("MoeConfig: bad", "src/common/moe_common.cpp:119")
    assert errors.split_location("no location [here]") == ("no location [here]", None)


def test_sync_free_on_cpu_is_accepted_with_a_warning():
    # documented choice (docs/PYTHON.md): a module built on the CPU may move to a GPU later, so
    # sync_free=True is accepted, and a CPU forward says once that it has no effect there
    m = MoE(H, F, E, K, recipe="bf16", seed=1, sync_free=True)
    x = torch.randn(8, H).bfloat16()
    with pytest.warns(UserWarning, match="sync_free=True has no effect on CPU"):
        m(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m(x)  # the layer is built once: no second warning
