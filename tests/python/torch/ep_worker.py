"""One rank of the expert-parallel CPU test (test_ep.py): gloo over a file store, the CPU layer's
host communicator over torch.distributed. Usage: ep_worker.py RANK WORLD STORE OUT LIB CASE."""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "python")))
import flowmoe  # noqa: E402
import flowmoe._native as native  # noqa: E402

from ep_common import EP_RECIPES, ep_inputs, ep_module  # noqa: E402


def main():
    rank, world, store, out, lib, case = sys.argv[1:7]
    rank, world = int(rank), int(world)
    if lib:
        native.set_library_path(lib)
    cuda = case == "values-cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    results = {}
    if case in ("values", "values-cuda"):
        dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
        for recipe in EP_RECIPES:
            m = ep_module(recipe, ep_group=dist.group.WORLD).to(dev)
            x, dy = (t.to(dev) for t in ep_inputs(rank))
            x.requires_grad_()
            y = m(x)
            y.backward(dy)
            results[recipe] = dict(y=y.detach().cpu(), dx=x.grad.cpu(), dw1=m.w1.grad.cpu(),
                                   dw2=m.w2.grad.cpu(), dwr=m.wr.grad.cpu(), wire=m.cast_report()["wire"])
            m.release()
    elif case == "mismatch":
        # rank 1 asks for another recipe: every rank must get an error, nobody hangs
        m = ep_module("flow" if rank == 0 else "bf16", ep_group=dist.group.WORLD)
        x, _ = ep_inputs(rank)
        try:
            m(x)
            results["error"] = None
        except flowmoe.FlowmoeError as e:
            results["error"] = (type(e).__name__, str(e))
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
