"""One rank of the FSDP2 CPU test (test_hf_fsdp.py): the tiny Qwen3-MoE of hf_common.py with flowmoe
experts, each decoder layer and the root sharded by ``torch.distributed.fsdp.fully_shard`` over gloo,
trained a few AdamW steps on this rank's part of each batch. Environment as torchrun sets it
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Usage: hf_fsdp_worker.py OUT LIB IMPL STEPS.

Writes OUT/rank{RANK}.pt: the losses (averaged over the ranks), which parameters are DTensors sharded
on dim 0, which local shards moved, the logits of the trained sharded model on an evaluation batch
and (rank 0) the full state dict gathered after training."""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..", "..", "python")))
sys.path.insert(0, HERE)
import flowmoe._native as native  # noqa: E402

import hf_fsdp_common as fc  # noqa: E402


def main():
    out, lib, impl, steps = sys.argv[1:5]
    steps = int(steps)
    if lib:
        native.set_library_path(lib)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    model = fc.model(impl)
    for layer in model.model.layers:  # each decoder layer, then the root (embeddings, final norm, head)
        fully_shard(layer)
    fully_shard(model)
    params = dict(model.named_parameters())
    sharded = {n: isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),) for n, p in params.items()}
    before = {n: p.to_local().detach().clone() for n, p in params.items()}

    opt = fc.optimizer(model)
    losses = []
    for step in range(steps):
        ids = fc.rank_batch(step, rank)
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every rank the same number of labels: the mean of the ranks' means
        losses.append(float(mean) / world)
    moved = {n: not torch.equal(p.to_local().detach(), before[n]) for n, p in params.items()}
    ran_flowmoe = any(getattr(m, "_flowmoe_options", None) is not None for m in model.modules())
    with torch.no_grad():
        logits = model(input_ids=fc.eval_batch()).logits.detach().float()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    res = dict(losses=losses, sharded=sharded, moved=moved, logits=logits, ran_flowmoe=ran_flowmoe,
               local_numel={n: p.to_local().numel() for n, p in params.items()})
    if rank == 0:
        res["state_dict"] = {k: v.detach().clone() for k, v in full.items()}
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    # End here, without the process group's teardown and the interpreter's. Ending normally
    # (destroy_process_group, then exit), one rank aborted in 2 of about 30 flowmoe-flow runs on the
    # 2-core CPU machine (none of about 20 eager / flowmoe-bf16 runs) with only "terminate called
    # without an active exception" (a joinable std::thread destroyed): once after its results were
    # written, once with nothing else printed. flowmoe's CPU layer starts no thread (src/: std::thread
    # only in the simulated communicator); gloo's process group does. Not pinned down further (GPU /
    # NCCL session: run the worker ending normally in a loop). Every rank's results are written and
    # every rank has reached the barrier.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
