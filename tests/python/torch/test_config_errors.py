"""Configuration mistakes in flowmoe.torch are ValueErrors that say what was wrong and what is
expected, raised up front, and no error message carries a C++ source location unless debugging is
on (flowmoe.set_debug). The rules and their words are the library's (C ABI flowmoe_config_check),
asked when a module is built. CPU only."""

import re
import warnings

import pytest
import torch

import flowmoe
import flowmoe._errors as errors
import flowmoe._native as native
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
    ((H, F, E, 0), r"top_k k = 0 out of range; expected 1 <= k <= 32"),
    ((H, F, E, 16), r"top_k k = 16 exceeds num_experts E = 4; expected k <= E \(each token picks k distinct"),
    ((H, F, E, 33), r"top_k k = 33 out of range; expected 1 <= k <= 32"),
    ((H, F, 2000, 2), r"num_experts E = 2000 out of range; expected 1 <= E <= 1024"),
    ((H, F, E, 2.0), r"topk = 2.0; expected an int"),
    ((H, F, 1 << 40, K), r"experts = 1099511627776 does not fit the C ABI's int32"),
    ((H, 200, E, K), r"ffn F = 200 is not a positive multiple of 128.*such as 128 or 256"),
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
    assert "hidden H = 100 is not a positive multiple of 128" in msg and "such as 128" in msg
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
    with pytest.raises(ValueError, match="top_k k = 3 exceeds num_experts E = 2") as info:
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


# ---- each rule in one place: the library's (issue 55) ------------------------------------------------
# The modules ask the C ABI's flowmoe_config_check (MoeConfig::validate, check_sync_free_options;
# here a CPU-only library works too) when they are built: their errors carry the library's message
# and its C++ location, no layer is made, and the Python package restates none of these rules.
LIBRARY_RULES = "src/common/moe_common.cpp"


def _library_says(cfg, **kw):
    """The text flowmoe_config_check gives for cfg (no location), or None when it accepts it."""
    try:
        native.check_config(cfg, **kw)
    except flowmoe.FlowmoeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kw,needle", [
    (dict(hidden=100), "hidden H = 100 is not a positive multiple of 128"),
    (dict(topk=5), "top_k k = 5 exceeds num_experts E = 4"),
    (dict(experts=2000), "num_experts E = 2000 out of range"),
    (dict(align=8), "align A = 8 not supported"),
    (dict(align=64, sync_free=True), "CudaLayerOptions::sync_free needs align = 128"),
    (dict(max_tokens=0), "max_tokens = 0; expected the largest T of a forward call"),
])
def test_module_errors_are_the_librarys_check(no_debug, kw, needle):
    args = dict(hidden=H, ffn=F, experts=E, topk=K, recipe="flow", align=128, max_tokens=16, sync_free=False)
    args.update(kw)
    with pytest.raises(flowmoe.ConfigError) as info:
        MoE(args["hidden"], args["ffn"], args["experts"], args["topk"], recipe=args["recipe"], align=args["align"],
            max_tokens=args["max_tokens"], sync_free=args["sync_free"])
    e = info.value
    assert e.location and e.location.startswith(LIBRARY_RULES + ":"), e.location  # raised by the library
    cfg = native.make_config(args["hidden"], args["ffn"], args["experts"], args["topk"], "softmax", False, 1.0, 0.0,
                             args["align"], args["recipe"], args["max_tokens"])
    said = _library_says(cfg, sync_free=args["sync_free"])
    assert said and needle in said
    assert str(e).startswith(f"flowmoe.torch.MoE: {said}"), (str(e), said)


def test_sync_free_rule_is_the_librarys_host_code(no_debug):
    # sync_free's needs (one GPU, align 128) are written once, in host code that make_cuda_layer runs
    # too: a CPU-only library refuses them with the same words, before any GPU work
    for cls in (MoE, MoEExperts):
        with pytest.raises(flowmoe.ConfigError, match=r"sync_free needs align = 128 .*; align is 64") as info:
            cls(H, F, E, K, align=64, sync_free=True)
        assert info.value.location.startswith(LIBRARY_RULES + ":")
        cls(H, F, E, K, align=64)  # without sync_free, align 64 is fine
    cfg = native.make_config(H, F, E, K, "softmax", False, 1.0, 0.0, 128, "flow", 16)
    assert _library_says(cfg, sync_free=True) is None
    said = _library_says(cfg, ep_world=2, sync_free=True)
    assert said and "sync_free with expert parallelism needs a communicator whose kernels reach the peers' memory" \
        in said and "expected sync_free off, or one GPU (no communicator)" in said
    assert _library_says(cfg, ep_world=2) is None
    assert "num_experts E = 4 is not divisible by the 3 ranks" in _library_says(cfg, ep_world=3)


def test_sync_free_with_an_ep_group_is_refused_by_the_library(no_debug):
    import os

    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + (os.getpid() + 7) % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with pytest.raises(flowmoe.ConfigError, match="sync_free with expert parallelism") as info:
            MoE(H, F, E, K, max_tokens=16, ep_group=dist.group.WORLD, sync_free=True)
        assert info.value.location.startswith(LIBRARY_RULES + ":")
        MoE(H, F, E, K, max_tokens=16, ep_group=dist.group.WORLD)  # one rank, no sync_free: fine
    finally:
        dist.destroy_process_group()


def test_gemm1_bias_with_fp8_naive_is_the_librarys_rule(no_debug):
    # experts() with b1 (GEMM1's bias) in fp8-naive: the library's refusal, at the layer's construction
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, H, generator=g).bfloat16()
    w1, w2 = torch.randn(E, 2 * F, H, generator=g) * 0.1, torch.randn(E, H, F, generator=g) * 0.1
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    b1 = torch.zeros(E, 2 * F)
    with pytest.raises(flowmoe.ConfigError, match=r"GEMM1 \(expert\) biases with the fp8-naive recipe are not "
                                                  r"supported; expected one of bf16, blockwise, flow, flow-fp4") as info:
        experts(x, ids, torch.full((6, 2), 0.5), w1, w2, recipe="fp8-naive", b1=b1)
    assert info.value.location.startswith(LIBRARY_RULES + ":")
    cfg = native.make_config(H, F, E, K, "softmax", False, 1.0, 0.0, 128, "fp8-naive", 1, external_routing=True,
                             gemm1_bias=True)
    assert str(info.value) == f"flowmoe.torch.experts: {_library_says(cfg)}"
    y = experts(x, ids, torch.full((6, 2), 0.5), w1, w2, recipe="flow", b1=b1)  # other recipes take it
    assert bool(torch.isfinite(y.float()).all())


def test_size_multiple_comes_from_the_library():
    assert native.size_multiple() == 128  # flowmoe_config_size_multiple (moe.h kMoeSizeMultiple)
    cfg = native.make_config(H, F, E, K, "softmax", False, 1.0, 0.0, 128, "flow", 1)
    assert native.lib().flowmoe_config_check(None, 0, None) == native.ERROR  # a null configuration
    assert native.lib().flowmoe_config_check(cfg, -1, None) == native.ERROR
    assert "ep_world = -1" in native.lib().flowmoe_last_error().decode()
