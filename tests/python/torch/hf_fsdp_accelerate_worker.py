"""One process of the accelerate FSDP2 CPU tests (test_hf_fsdp.py, test_accelerate_*): the tiny Qwen3-MoE of
hf_common.py prepared by ``accelerate.Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(
fsdp_version=2, auto_wrap_policy="transformer_based_wrap"))`` in a gloo process group of world size 1
(torchrun's environment: RANK, WORLD_SIZE=1, MASTER_ADDR, MASTER_PORT), then trained a few AdamW steps
on the whole batch of every step. Usage: hf_fsdp_accelerate_worker.py OUT LIB IMPL STEPS MODE.

MODE "probe": only what accelerate makes of the plugin on a CPU, through its public API (the state's
distributed type, is_fsdp2, the class prepare() returns). Writes OUT/probe.pt.

MODE "train": accelerate 1.16 does not pick FSDP on a CPU (AcceleratorState.__init__ in
accelerate/state.py sets DistributedType.FSDP only inside its branch for MULTI_GPU / MLU / SDAA / MUSA /
NPU / XPU / HPU / NEURON processes; a CPU process stays MULTI_CPU, and prepare() then wraps the model
in DistributedDataParallel, the plugin unused). Where it did not pick it, this sets the two things
that branch sets on a GPU (see force_fsdp) and then runs accelerate's own FSDP2 path: prepare()
(_prepare_fsdp2, fsdp2_prepare_model: fully_shard on each Qwen3MoeDecoderLayer of the model's
_no_split_modules, on the input embedding, on [final norm, lm_head], on the root; the optimizer moved
onto the sharded parameters), accelerator.backward, accelerator.get_state_dict. Writes OUT/train.pt."""

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..", "..", "python")))
sys.path.insert(0, HERE)
import flowmoe._native as native  # noqa: E402

import hf_fsdp_common as fc  # noqa: E402


def _local(p):
    """A parameter's local shard (the parameter itself if it is not a DTensor: the test says which)."""
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def make_accelerator():
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    # transformer_based_wrap: the usual FSDP config (wrap the model's _no_split_modules); the default
    # NO_WRAP would shard only the embedding, the tail and the root
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    # cpu=True with RANK / WORLD_SIZE set: accelerate's MULTI_CPU path, which starts gloo itself
    return Accelerator(cpu=True, mixed_precision="no", fsdp_plugin=plugin), plugin


def force_fsdp(acc, plugin):
    """What AcceleratorState.__init__ does on a GPU process given an fsdp_plugin: distributed_type =
    FSDP, fsdp_plugin = plugin, and the same distributed_type in PartialState's shared state (each
    later AcceleratorState() copies PartialState's shared state over its own: setting only the
    Accelerator's state, prepare() shards the model but the state is MULTI_CPU again after it, and
    get_state_dict returns the DTensors). With mixed_precision "no" nothing else of
    Accelerator.__init__ depends on it (only the FP8 / FP16 scaler choices)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def probe(out, impl):
    from torch.distributed.fsdp import FSDPModule

    acc, _ = make_accelerator()
    model = fc.model(impl)
    model, opt = acc.prepare(model, fc.optimizer(model))
    res = dict(distributed_type=str(acc.distributed_type), is_fsdp2=bool(acc.is_fsdp2),
               prepared=type(model).__name__, world=torch.distributed.get_world_size(),
               fsdp_modules=[n for n, m in model.named_modules() if isinstance(m, FSDPModule)])
    torch.save(res, os.path.join(out, "probe.pt"))


def train(out, impl, steps):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    acc, plugin = make_accelerator()
    if not acc.is_fsdp2:
        force_fsdp(acc, plugin)
    assert acc.is_fsdp2, f"accelerate's state is not FSDP2 after setting it: {acc.distributed_type}"

    model = fc.model(impl)
    full = {n: p.numel() for n, p in model.named_parameters()}
    opt = fc.optimizer(model)
    model, opt = acc.prepare(model, opt)
    params = dict(model.named_parameters())
    sharded = {n: isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),) for n, p in params.items()}
    meshes = {(p.device_mesh.device_type, p.device_mesh.size()) for p in params.values() if isinstance(p, DTensor)}
    local_numel = {n: _local(p).numel() for n, p in params.items()}
    # accelerate swaps the optimizer's parameters for the sharded ones (fsdp2_switch_optimizer_parameters)
    opt_ids = {id(p) for g in opt.param_groups for p in g["params"]}
    before = {n: _local(p).detach().clone() for n, p in params.items()}

    # what the experts modules hold while they run: FSDP2 all-gathers a layer's parameters in the
    # layer's pre-forward, so the experts' forward sees the unsharded parameters
    seen = set()
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    for m in experts:
        m.register_forward_pre_hook(lambda mod, args: seen.add(type(mod.gate_up_proj).__name__))

    losses = []
    for step in range(steps):
        ids = fc.full_batch(step)  # the whole batch of the reference (one process holds every shard)
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        losses.append(float(loss.detach()))
    moved = {n: not torch.equal(_local(p).detach(), before[n]) for n, p in params.items()}
    # set at the first call of flowmoe's experts forward (flowmoe/hf.py); nothing ran before prepare()
    ran_flowmoe = [getattr(m, "_flowmoe_options", None) is not None for m in experts]
    with torch.no_grad():
        logits = model(input_ids=fc.eval_batch()).logits.detach().float()
    state_dict = acc.get_state_dict(model)
    res = dict(threads=torch.get_num_threads(), losses=losses, sharded=sharded, meshes=meshes, full_numel=full,
               local_numel=local_numel, optimizer_holds_model_params=opt_ids == {id(p) for p in params.values()},
               fsdp_modules=[n for n, m in model.named_modules() if isinstance(m, FSDPModule)],
               moved=moved, experts_saw=sorted(seen), ran_flowmoe=ran_flowmoe, logits=logits,
               state_dict={k: v.detach().clone() for k, v in state_dict.items()})
    torch.save(res, os.path.join(out, "train.pt"))


def main():
    out, lib, impl, steps, mode = sys.argv[1:6]
    if lib:
        native.set_library_path(lib)
    if mode == "probe":
        probe(out, impl)
    else:
        train(out, impl, int(steps))
    # End as hf_fsdp_worker.py does (its comment: a rare "terminate called without an active
    # exception" at the teardown of two ranks, 2 in ~30 flowmoe-flow runs); the results are written.
    # This one process ending normally (destroy_process_group, then exit) did not abort in 20
    # flowmoe-flow runs, which does not rule out that rate.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
