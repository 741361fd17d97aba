"""bench/hf_stack.py --tiny --device cpu (issue 53): the fine-tuning-stack benchmark's smoke run.

Every scenario (Liger, LoRA on attention, LoRA on attention and experts, torchao float8 on the dense
layers, plain full fine-tuning) for `grouped_mm` and `flowmoe-flow` gets a row: either trained (finite
losses, the experts still dispatched through experts_implementation, flowmoe's layers built for the
flowmoe rows) or skipped with a recorded reason, never an error. A scenario's package (peft,
liger-kernel, torchao) may be missing: its rows must then be skipped naming it; where it is installed
the rows must run (or, for Liger and float8 on a CPU, be skipped for the stated device reason after the
patch / conversion was applied and checked). The Liger patch must leave transformers' qwen3_moe module
as it found it, and the benchmark's experts check must see Liger's default (swiglu=True) take the
experts away from experts_implementation."""

import importlib
import json
import math
import os
import runpy

import pytest

import hf_common as hc

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
SCENARIOS = ["liger", "lora-attn", "lora-experts", "float8-dense", "plain"]
IMPLS = ["grouped_mm", "flowmoe-flow"]
LAYERS = 2  # the --tiny model's


def _importable(module):
    try:
        importlib.import_module(module)
        return True
    except Exception:
        return False


@pytest.fixture(scope="module")
def bench():
    return runpy.run_path(os.path.join(ROOT, "bench", "hf_stack.py"))


@pytest.fixture(scope="module")
def run(bench, tmp_path_factory):
    """One smoke run of every scenario (about 10 s on 2 cores); (exit code, the JSON)."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as mod

    before = dict(vars(mod)), mod.Qwen3MoeForCausalLM.forward
    out = tmp_path_factory.mktemp("hf_stack") / "stack.json"
    rc = bench["main"](["--tiny", "--device", "cpu", "--scenarios", *SCENARIOS, "--impls", *IMPLS,
                        "--json", str(out)])
    after = dict(vars(mod)), mod.Qwen3MoeForCausalLM.forward
    return rc, json.loads(out.read_text()), before, after


def _rows(result):
    return {(r["scenario"], r["impl"]): r for r in result["rows"]}


def test_a_row_per_scenario_and_impl(run):
    rc, result, _, _ = run
    assert rc == 0
    assert [(r["scenario"], r["impl"]) for r in result["rows"]] == [(s, i) for s in SCENARIOS for i in IMPLS]
    for r in result["rows"]:
        assert "error" not in r, r
        if "skipped" in r:
            assert r["skipped"].strip(), r
            continue
        assert all(math.isfinite(x) for x in r["losses"]) and len(r["losses"]) == 3, r
        assert math.isfinite(r["final_loss"]) and math.isfinite(r["val_loss"]), r
        assert r["tokens_per_s"] > 0 and r["trainable_parameters"] > 0, r
        ex = r["experts"]
        assert ex["use_experts_implementation"] and ex["modules"] == LAYERS, r
        assert ex["implementation"] == [r["impl"]], r
        assert ex["flowmoe_layers"] == (LAYERS if r["impl"].startswith("flowmoe") else 0), r


def test_scenarios_run_where_their_package_is(run):
    """A row is skipped only for a missing package or a stated device reason; plain always runs."""
    _, result, _, _ = run
    rows = _rows(result)
    peft, liger, torchao = _importable("peft"), _importable("liger_kernel.transformers"), _importable("torchao.float8")
    for impl in IMPLS:
        assert "skipped" not in rows["plain", impl]
        for s in ("lora-attn", "lora-experts"):
            r = rows[s, impl]
            if not peft:
                assert "pip install peft" in r["skipped"], r
            elif s == "lora-attn" or "target_parameters" not in r.get("skipped", ""):  # (PEFT < 0.17)
                assert "skipped" not in r, r
        r = rows["liger", impl]
        if not liger:
            assert "pip install liger-kernel" in r["skipped"], r
        else:  # on a CPU: the patch applied, the experts checked, then skipped (Triton needs CUDA)
            assert "Triton" in r["skipped"], r
            assert r["experts"]["use_experts_implementation"] and r["experts"]["implementation"] == [impl], r
            assert r["causal_lm_forward"].startswith("liger_kernel"), "fused linear cross-entropy forward"
            assert r["liger"]["swiglu"] is False
        r = rows["float8-dense", impl]
        if not torchao:
            assert "pip install torchao" in r["skipped"], r
        else:  # every attention projection and lm_head converted, nothing else left as nn.Linear
            assert r["float8"]["modules"] == 4 * LAYERS + 1 and r["float8"]["lm_head"], r
            assert r["float8"]["kept"] == [], r
            assert "skipped" not in r or "_scaled_mm" in r["skipped"], r


def test_same_weights_and_data_for_every_impl(run):
    """The implementations of a scenario start from the same weights on the same data: the same
    trainable parameters, and first-step losses within flowmoe-flow's loss bound of grouped_mm's."""
    _, result, _, _ = run
    rows = _rows(result)
    ran = [s for s in SCENARIOS if all("losses" in rows[s, i] for i in IMPLS)]
    assert "plain" in ran
    bound = hc.BOUNDS["flow"][1]
    for s in ran:
        a, b = rows[s, "grouped_mm"], rows[s, "flowmoe-flow"]
        assert a["trainable_parameters"] == b["trainable_parameters"], s
        assert abs(a["losses"][0] - b["losses"][0]) < bound, (s, a["losses"], b["losses"])
    total = rows["plain", "grouped_mm"]["trainable_parameters"]
    assert total == rows["plain", "grouped_mm"]["total_parameters"]
    if "lora-attn" in ran and "lora-experts" in ran:
        attn, both = rows["lora-attn", "grouped_mm"], rows["lora-experts", "grouped_mm"]
        assert 0 < attn["trainable_parameters"] < both["trainable_parameters"] < total
        assert both["lora"]["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_liger_patch_is_undone(run):
    """After the run transformers' qwen3_moe module holds what it held before (models built later in
    the process are unpatched)."""
    _, _, (vars_before, fwd_before), (vars_after, fwd_after) = run
    assert fwd_after is fwd_before
    assert vars_after.keys() == vars_before.keys()
    changed = [k for k in vars_before if vars_after[k] is not vars_before[k]]
    assert not changed, changed


def test_experts_check_sees_liger_default_replacing_the_experts(bench):
    """Liger's default swiglu=True binds LigerExperts.forward to every experts module: the benchmark's
    check must report that the experts no longer use experts_implementation (and swiglu=False that they
    do), or its "experts" column could not be trusted."""
    try:
        import liger_kernel.transformers as lt
    except Exception as e:
        pytest.skip(f"liger-kernel is not importable ({e}): pip install liger-kernel")
    for swiglu in (True, False):
        model = hc.build(hc.qwen3_moe, "flowmoe-flow")
        with bench["restored_qwen3_moe"]():
            lt.apply_liger_kernel_to_qwen3_moe(model=model, swiglu=swiglu)
            rec = bench["experts_record"](model)
        assert rec["modules"] == 2
        assert rec["use_experts_implementation"] is (not swiglu), (swiglu, rec)
        assert ("LigerExperts" in rec["names"]) is swiglu, (swiglu, rec)
