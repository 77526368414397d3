"""Started as pytorch/examples' ddp-tutorial-series/multigpu.py starts its processes:
torch.multiprocessing.spawn, one process per device, `init_process_group` imported at the top
(before the bridge is active in the spawned process), `torch.cuda.set_device(rank)` before it,
MASTER_ADDR and MASTER_PORT set by the script; rank 0 saves a checkpoint (tests/test_distributed.py)."""

import os
import socket
import sys

import torch
import torch.multiprocessing as mp
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    init_process_group(backend="nccl", rank=rank, world_size=world_size)


def main(rank, world_size, port, folder):
    setup(rank, world_size, port)
    model = torch.nn.Linear(20, 1).to(rank)
    model = DDP(model, device_ids=[rank])
    print(f"rank {rank} of {world_size} on {next(model.parameters()).device}", flush=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(8, 20).to(rank)).square().mean().backward()
        optimizer.step()
    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(folder, "checkpoint.pt"))
    destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as probe:  # a free port for torch's store (the bridge's coordinator takes the next)
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    world_size = torch.cuda.device_count()
    mp.spawn(main, args=(world_size, port, sys.argv[1]), nprocs=world_size)
