"""flowmoe communicators from a torch.distributed process group (expert parallelism, docs/PYTHON.md).

- CUDA tensors: flowmoe's NCCL communicator. Group rank 0 makes the NCCL unique id, the group
  broadcasts it (torch.distributed, no second rendezvous), every rank creates the communicator on
  its device.
- CPU tensors: a host-memory communicator whose bytes travel over the group itself (point-to-point
  isend/irecv, e.g. gloo): the CPU backend's expert parallelism across processes.
"""

from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist

from . import _native


def _global_rank(group, rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def _broadcast_bytes(group, payload: bytes, device: torch.device) -> bytes:
    buf = torch.zeros(len(payload), dtype=torch.uint8, device=device)
    if dist.get_rank(group) == 0:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buf, src=_global_rank(group, 0), group=group)
    return bytes(buf.cpu().tolist())


def nccl_comm_from_group(group, device: torch.device, timeout_s: float) -> _native.Comm:
    if not _native.has_nccl():
        raise _native.FlowmoeError("flowmoe.torch.MoE: ep_group with CUDA tensors needs the NCCL "
                                   "communicator, but this flowmoe library was built without NCCL")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    index = device.index if device.index is not None else torch.cuda.current_device()
    uid = _native.nccl_unique_id() if rank == 0 else bytes(128)
    # the id travels over the group's own backend: a CUDA tensor for NCCL groups, a CPU one otherwise
    bdev = torch.device("cuda", index) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    uid = _broadcast_bytes(group, uid, bdev)
    return _native.nccl_comm(rank, world, uid, index, timeout_s)


def _view(address: int, nbytes: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


class _GroupTransport:
    """Communicator primitives over a torch.distributed group (CPU tensors)."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def exchange(self, sends, recvs) -> None:
        # Self ops are local copies (k-th send to self -> k-th recv from self); the k-th message
        # between two ranks carries tag k, so matching never depends on the transport's order.
        own_s = [s for s in sends if s[0] == self.rank]
        own_r = [r for r in recvs if r[0] == self.rank]
        if len(own_s) != len(own_r):
            raise RuntimeError(f"exchange: {len(own_s)} send(s) to this rank but {len(own_r)} recv(s)")
        for (_, src, n), (_, dst, m) in zip(own_s, own_r):
            if n != m:
                raise RuntimeError(f"exchange: local copy of {n} bytes into a {m}-byte recv")
            if n:
                ctypes.memmove(dst, src, n)
        works, tags = [], {}
        for peer, addr, n in recvs:
            if peer == self.rank:
                continue
            tag = tags[("r", peer)] = tags.get(("r", peer), -1) + 1
            if n:
                works.append(dist.irecv(_view(addr, n), src=_global_rank(self.group, peer),
                                        group=self.group, tag=tag))
        for peer, addr, n in sends:
            if peer == self.rank:
                continue
            tag = tags[("s", peer)] = tags.get(("s", peer), -1) + 1
            if n:
                works.append(dist.isend(_view(addr, n), dst=_global_rank(self.group, peer),
                                        group=self.group, tag=tag))
        for w in works:
            w.wait()

    def alltoall_i32(self, send: int, recv: int, n: int) -> None:
        b = 4 * n
        self.exchange([(p, send + p * b, b) for p in range(self.world)],
                      [(p, recv + p * b, b) for p in range(self.world)])

    def barrier(self) -> None:
        dist.barrier(group=self.group)


def host_comm_from_group(group, timeout_s: float) -> _native.Comm:
    t = _GroupTransport(group)
    comm = _native.host_comm(t.rank, t.world, t.alltoall_i32, t.exchange, t.barrier, timeout_s)
    comm._transport = t
    return comm
