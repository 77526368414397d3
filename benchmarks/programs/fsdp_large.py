"""FSDP2 training of a model too large for one GPU: pytorch/examples' FSDP2 Transformer (its own
model.py, imported from a checkout of pytorch/examples) at about 4.3 B parameters, sharded with
`fully_shard` per block and at the root, made on the meta device and moved with `to_empty`, as
large models are. Adam in float32: its parameters, gradients and moments alone need about 69 GB,
and one GPU would also hold the activations of the whole global batch.

    torchrun --nproc-per-node 4 fsdp_large.py --fsdp2 EXAMPLES/distributed/FSDP2
    python -m bridge run --nproc-per-node 4 fsdp_large.py --fsdp2 EXAMPLES/distributed/FSDP2
    python fsdp_large.py --fsdp2 ... --single     (one GPU, the global batch: runs out of memory)

Prints each step's loss and milliseconds, then the median step time after the first two steps,
tokens per second per GPU and the peak memory of rank 0's GPU.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--fsdp2", required=True, help="pytorch/examples' distributed/FSDP2 folder (its model.py)")
parser.add_argument("--layers", type=int, default=20)
parser.add_argument("--dim", type=int, default=4096)
parser.add_argument("--heads", type=int, default=32)
parser.add_argument("--vocab", type=int, default=32000)
parser.add_argument("--seq", type=int, default=512)
parser.add_argument("--batch", type=int, default=4, help="sequences per GPU and step")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--single", action="store_true", help="one process, one GPU, the global batch of 4 GPUs")
parser.add_argument("--phases", action="store_true",
                    help="wait for the device after the forward, the backward and the step, and print each one's ms")
parser.add_argument("--profile", help="write rank 0's host profile (cProfile) of the steps after the second here")
options = parser.parse_args()
sys.path.insert(0, options.fsdp2)
from model import ModelArgs, Transformer  # noqa: E402  (pytorch/examples' own model)

arguments = ModelArgs(n_layers=options.layers, vocab_size=options.vocab, max_seq_len=options.seq, dim=options.dim,
                      n_heads=options.heads, dropout_p=0.0)
if options.single:
    rank, world, device = 0, 1, torch.device("cuda", 0)
    batch = options.batch * 4
else:
    from torch.distributed.fsdp import fully_shard

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = options.batch

with torch.device("meta"):
    model = Transformer(arguments)
if not options.single:
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
model.to_empty(device=device)
torch.manual_seed(rank)
with torch.no_grad():  # each rank fills its own shards (ones for the norms' weights, as torch makes them)
    for name, parameter in model.named_parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        if name.endswith("norm.weight"):
            local.fill_(1.0)
        elif name.endswith("bias"):
            local.zero_()
        else:
            local.normal_(0.0, 0.02)
count = sum(parameter.numel() for parameter in model.parameters())
optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
if rank == 0:
    print(f"parameters {count / 1e9:.2f} B, {world} process(es), batch {batch} x {options.seq} per process", flush=True)

generator = torch.Generator().manual_seed(100 + rank)
times = []
profiler = None
if options.profile and rank == 0:
    import cProfile

    profiler = cProfile.Profile()


def phase(name, started):
    if options.phases:
        torch.cuda.synchronize()
        if rank == 0:
            print(f"  {name} {(time.perf_counter() - started) * 1000:.1f}ms", flush=True)
    return time.perf_counter()


for step in range(options.steps):
    tokens = torch.randint(0, options.vocab, (batch, options.seq + 1), generator=generator).to(device)
    torch.cuda.synchronize()
    if profiler is not None and step == 2:
        profiler.enable()
    started = time.perf_counter()
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    mark = phase("forward", started)
    loss.backward()
    mark = phase("backward", mark)
    optimizer.step()
    optimizer.zero_grad()
    phase("step", mark)
    value = loss.detach()
    if world > 1:
        dist.all_reduce(value)
        value /= world
    value = value.item()
    torch.cuda.synchronize()
    times.append((time.perf_counter() - started) * 1000)
    if rank == 0:
        print(f"step {step} loss {value:.5f} time {times[-1]:.1f}ms", flush=True)

if profiler is not None:
    import io
    import pstats

    profiler.disable()
    text = io.StringIO()
    for order, count in (("cumulative", 70), ("tottime", 40)):
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(count)
    with open(options.profile, "w") as handle:
        handle.write(text.getvalue())
if rank == 0:
    median = statistics.median(times[2:]) if len(times) > 2 else times[-1]
    print(f"median {median:.1f} ms/step, {batch * options.seq / (median / 1000):,.0f} tokens/s per GPU, "
          f"peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB on rank 0", flush=True)
if world > 1:
    dist.destroy_process_group()
