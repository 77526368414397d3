"""FSDP2 (`fully_shard`) training as its tutorial writes it: each block and the root sharded over
a 1-D device mesh, AdamW, a full state dict gathered for rank 0's checkpoint; run by
tests/test_distributed.py under plain torch with gloo, under the bridge, and as one process
with the same global batch (no sharding)."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda")
parser.add_argument("--backend", default="nccl")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--batch", type=int, default=8, help="global batch")
parser.add_argument("--checkpoint")
parser.add_argument("--meta", action="store_true",
                    help="as large models are made: on the meta device, sharded over FSDP's default mesh, moved "
                         "with to_empty, rank 0's full state dict broadcast into the shards")
options = parser.parse_args()

distributed = "RANK" in os.environ
if distributed:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    local_rank = int(os.environ["LOCAL_RANK"])
    if options.device == "cuda":
        torch.cuda.set_device(local_rank)
    device = torch.device(options.device, local_rank) if options.device == "cuda" else torch.device("cpu")
    dist.init_process_group(options.backend, device_id=device if options.meta else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = None if options.meta else init_device_mesh(options.device, (world,))
else:
    rank, world, device = 0, 1, torch.device(options.device)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        return x + torch.tanh(self.linear(self.norm(x)))


def make():
    return torch.nn.Sequential(torch.nn.Linear(6, 16), Block(), Block(), torch.nn.Linear(16, 3))


torch.manual_seed(0)
if distributed and options.meta:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = make().state_dict() if rank == 0 else {}
    with torch.device("meta"):
        model = make()
else:
    model = make().to(device)
if distributed:
    for block in model[1:3]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if options.meta:
        model.to_empty(device=device)
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)

generator = torch.Generator().manual_seed(1)
inputs_all, targets_all = torch.randn(64, 6, generator=generator), torch.randint(0, 3, (64,), generator=generator)
local = options.batch // world
for step in range(options.steps):
    start = step * options.batch + rank * local
    inputs, targets = inputs_all[start:start + local].to(device), targets_all[start:start + local].to(device)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    reported = loss.detach().clone()
    if distributed:
        dist.all_reduce(reported)
        reported /= world
    if rank == 0:
        print(f"step {step} loss {reported.item():.7f}", flush=True)

if distributed:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=full)
    assert len(optimizer.state_dict()["state"]) == len(list(model.parameters()))  # torch's own: this rank's shards
    moments = get_optimizer_state_dict(model, optimizer, options=full).get("state", {})  # (rank 0's alone)
else:
    state = {key: value.cpu() for key, value in model.state_dict().items()}
    names = [name for name, _ in model.named_parameters()]
    moments = {names[k]: entry for k, entry in optimizer.state_dict()["state"].items()}
if rank == 0:
    flat = torch.cat([value.flatten() for value in state.values()])
    print("weights", " ".join(f"{value:.7f}" for value in flat[-12:].tolist()), flush=True)
    if options.checkpoint:
        torch.save(state, options.checkpoint)
        torch.save({f"{name}.{kind}": value.cpu() for name, entry in moments.items() for kind, value in entry.items()},
                   options.checkpoint + ".optimizer")
if distributed:
    dist.barrier()
    dist.destroy_process_group()
