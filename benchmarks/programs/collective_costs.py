"""What one collective costs a step, as FSDP2 calls them: all_gather_into_tensor and
reduce_scatter_tensor of a block's worth of float32 (`--mb` per rank), each timed alone and in
FSDP's alternation, with the device waited for after each call. Run under torchrun (plain torch,
NCCL) or `python -m bridge run --nproc-per-node N` (the bridge):

    torchrun --nproc-per-node 2 collective_costs.py
    python -m bridge run --nproc-per-node 2 collective_costs.py

Prints rank 0's median milliseconds per call of each pattern.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--mb", type=int, default=400, help="megabytes each rank contributes")
parser.add_argument("--repeats", type=int, default=8)
options = parser.parse_args()

local_rank = int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", local_rank)
torch.cuda.set_device(device)
dist.init_process_group("nccl", device_id=device)
rank, world = dist.get_rank(), dist.get_world_size()
count = options.mb * 2**20 // 4
shard = torch.randn(count, device=device)
gathered = torch.empty(count * world, device=device)
other = torch.randn(count * world // 2, device=device)  # a second shape, as another block kind
other_out = torch.empty(count // 2, device=device)


def timed(name, call):
    times = []
    for _ in range(options.repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1000)
    if rank == 0:
        print(f"{name}: median {statistics.median(times[1:]):.2f} ms, first {times[0]:.1f} ms", flush=True)


timed("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(gathered, shard))
timed("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(shard, gathered))
timed("all_gather then reduce_scatter", lambda: (dist.all_gather_into_tensor(gathered, shard),
                                                 dist.reduce_scatter_tensor(shard, gathered)))
timed("two shapes in turn", lambda: (dist.all_gather_into_tensor(gathered, shard),
                                     dist.reduce_scatter_tensor(other_out, other)))


def copy_in():  # FSDP's all_gather_copy_in: a fresh output, this rank's part written
    output = torch.empty(count * world, device=device)
    output.narrow(0, count * rank, count).copy_(shard)
    dist.all_gather_into_tensor(output, output.narrow(0, count * rank, count))


timed("fresh output, copy in, all_gather", copy_in)
timed("copy alone", lambda: torch.empty(count * world, device=device).narrow(0, count * rank, count).copy_(shard))
dist.destroy_process_group()
