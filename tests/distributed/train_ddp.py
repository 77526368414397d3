"""A DistributedDataParallel training script as users write them (torchrun's environment,
DistributedSampler, rank-0 checkpointing), run by tests/test_distributed.py under plain torch
with gloo, under the bridge, and as one process with the same global batch."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="nccl")
parser.add_argument("--device", default="cuda")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--batch", type=int, default=8, help="global batch")
parser.add_argument("--optimizer", default="sgd")
parser.add_argument("--norm", action="store_true", help="a BatchNorm layer (its buffers are broadcast)")
parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step, all but the last under no_sync()")
parser.add_argument("--checkpoint")
parser.add_argument("--clip", type=float, help="clip_grad_norm_ before each step")
parser.add_argument("--peek", action="store_true", help="rank 0 reads a gradient between backward and step")
parser.add_argument("--comm-hook", choices=["allreduce", "fp16", "builtin"],
                    help="a DDP communication hook: torch's allreduce_hook, fp16_compress_hook, or the builtin ALLREDUCE")
options = parser.parse_args()

distributed = "RANK" in os.environ
if distributed:
    dist.init_process_group(options.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(options.device, local_rank) if options.device == "cuda" else torch.device("cpu")
    if options.device == "cuda":
        torch.cuda.set_device(local_rank)
else:
    rank, world, device = 0, 1, torch.device(options.device)

torch.manual_seed(0)
layers = [torch.nn.Linear(6, 16), torch.nn.Tanh()]
if options.norm:
    layers.append(torch.nn.BatchNorm1d(16))
layers += [torch.nn.Linear(16, 3)]
model = torch.nn.Sequential(*layers).to(device)
if rank == 1:  # different starting weights: DDP's broadcast must give every rank rank 0's
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
if distributed:
    model = DistributedDataParallel(model, device_ids=[local_rank] if options.device == "cuda" else None)
    if options.comm_hook == "builtin":
        model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    elif options.comm_hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.allreduce_hook if options.comm_hook == "allreduce" else default_hooks.fp16_compress_hook
        model.register_comm_hook(None, hook)
optimizer = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if options.optimizer == "sgd"
             else torch.optim.AdamW(model.parameters(), lr=0.01))

generator = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(64, 6, generator=generator), torch.randint(0, 3, (64,), generator=generator))
sampler = DistributedSampler(data, shuffle=False) if distributed else None
loader = DataLoader(data, batch_size=options.batch // world // options.accumulate, sampler=sampler, shuffle=False)

batches = iter(loader)
for step in range(options.steps):
    optimizer.zero_grad()
    for micro in range(options.accumulate):
        inputs, targets = next(batches)
        inputs, targets = inputs.to(device), targets.to(device)
        last = micro == options.accumulate - 1
        context = model.no_sync() if distributed and not last else torch.enable_grad()
        with context:
            loss = F.cross_entropy(model(inputs), targets) / options.accumulate
            loss.backward()
    if options.clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), options.clip)
    if options.peek and rank == 0:
        print("first gradient", float(next(model.parameters()).grad.flatten()[0]))
    optimizer.step()
    reported = loss.detach() * options.accumulate
    if distributed:
        dist.all_reduce(reported, op=dist.ReduceOp.SUM)
        reported /= world
    if rank == 0:
        print(f"step {step} loss {reported.item():.7f}")

module = model.module if distributed else model
if rank == 0:
    print("weights", " ".join(f"{value:.7f}" for value in torch.cat([p.detach().flatten() for p in module.parameters()]).cpu()[:12].tolist()))
    if options.checkpoint:
        torch.save(model.state_dict(), options.checkpoint)
if distributed:
    dist.barrier()
    dist.destroy_process_group()
