"""Every collective and ReduceOp on a few dtypes, each result printed by rank; run by
tests/test_distributed.py under plain torch with gloo and under the bridge, whose printouts must
agree line for line. ReduceOp.AVG, which gloo lacks, is printed as SUM / world size by torch."""

import datetime
import os
import sys

import torch
import torch.distributed as dist

device, folder = sys.argv[1], sys.argv[2]  # "cuda" under the bridge, "cpu" for plain torch; where to write
bridged = device == "cuda"
dist.init_process_group("nccl" if bridged else "gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
if bridged:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


lines = open(os.path.join(folder, f"rank{rank}.txt"), "w")


def say(text):
    print(text, file=lines, flush=True)


def show(name, value):
    values = value if isinstance(value, (list, tuple)) else [value]
    text = " | ".join(" ".join(f"{x:.6g}" if isinstance(x, float) else str(x) for x in v.flatten().tolist()) for v in values)
    say(f"{name}: {text}")


def made(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype, device=device)


operations = {"SUM": dist.ReduceOp.SUM, "PRODUCT": dist.ReduceOp.PRODUCT, "MIN": dist.ReduceOp.MIN,
              "MAX": dist.ReduceOp.MAX}
for dtype in (torch.float32, torch.int64, torch.float64):
    for name, operation in operations.items():
        tensor = made([rank + 1, 2 - rank, -rank, 3], dtype)
        dist.all_reduce(tensor, op=operation)
        show(f"all_reduce {name} {dtype}", tensor)
for name, operation in {"BAND": dist.ReduceOp.BAND, "BOR": dist.ReduceOp.BOR, "BXOR": dist.ReduceOp.BXOR}.items():
    tensor = made([rank + 1, 6, 5 * rank, 12 + rank], torch.int64)
    dist.all_reduce(tensor, op=operation)
    show(f"all_reduce {name}", tensor)
tensor = made([rank + 1.0, 4.0])
if bridged:
    dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
else:
    dist.all_reduce(tensor)
    tensor /= world
show("all_reduce AVG", tensor)
flags = torch.tensor([rank == 0, True, False], device=device)
dist.all_reduce(flags, op=dist.ReduceOp.MAX)
show("all_reduce MAX bool", flags)

tensor = made([rank * 10.0 + 1, -rank * 1.0])
dist.broadcast(tensor, src=world - 1)
show("broadcast", tensor)
outputs = [made([0.0, 0.0]) for _ in range(world)]
dist.all_gather(outputs, made([rank, rank * rank]))
show("all_gather", outputs)
output = made([0.0] * (2 * world))
dist.all_gather_into_tensor(output, made([rank + 0.5, -rank]))
show("all_gather_into_tensor", output)
output = made([0.0, 0.0])
dist.reduce_scatter_tensor(output, made([float(rank * 100 + i) for i in range(2 * world)]))
show("reduce_scatter_tensor", output)
output = made([0.0])
dist.reduce_scatter(output, [made([float(rank + i)]) for i in range(world)], op=dist.ReduceOp.MAX)
show("reduce_scatter MAX", output)
output = made([0.0] * world)
dist.all_to_all_single(output, made([float(rank * 10 + i) for i in range(world)]))
show("all_to_all_single", output)
outputs = [made([0.0, 0.0]) for _ in range(world)]
dist.all_to_all(outputs, [made([rank, i]) for i in range(world)])
show("all_to_all", outputs)
# Uneven splits (a mixture of experts' token exchange): rank r sends i + r + 1 rows to rank i.
sent = [i + rank + 1 for i in range(world)]
received = [rank + i + 1 for i in range(world)]
rows = torch.arange(sum(sent), dtype=torch.float32).reshape(-1, 1) * 100 + rank
output = made([[0.0]] * sum(received))
dist.all_to_all_single(output, rows.to(device), output_split_sizes=received, input_split_sizes=sent)
show("all_to_all_single uneven", output)
tensor = made([rank + 2.0])
dist.reduce(tensor, dst=0, op=dist.ReduceOp.PRODUCT)
if rank == 0:  # elsewhere torch leaves the tensor unspecified (gloo: partial results)
    show("reduce", tensor)
gathered = [made([0.0]) for _ in range(world)] if rank == 0 else None
dist.gather(made([rank * 3.0]), gathered, dst=0)
if rank == 0:
    show("gather", gathered)
output = made([0.0, 0.0])
dist.scatter(output, [made([i, -i]) for i in range(world)] if rank == 1 else None, src=1)
show("scatter", output)
if rank in (0, 1):
    tensor = made([7.0, 8.0]) if rank == 0 else made([0.0, 0.0])
    (dist.send(tensor, dst=1) if rank == 0 else dist.recv(tensor, src=0))
    show("send/recv", tensor)
work = dist.all_reduce(made([1.0]), async_op=True)
say(f"async wait: {work.wait()}")
objects = [None] * world
dist.all_gather_object(objects, {"rank": rank, "name": f"worker{rank}"})
say(f"all_gather_object: {objects}")
sent = [{"config": [1, 2]}] if rank == 0 else [None]
dist.broadcast_object_list(sent, src=0)
say(f"broadcast_object_list: {sent}")
evens = dist.new_group([r for r in range(world) if r % 2 == 0])
if rank % 2 == 0:
    tensor = made([rank + 1.0])
    dist.all_reduce(tensor, group=evens)
    show("all_reduce new_group(evens)", tensor)
host = torch.tensor([rank + 1.0, 0.5])  # a host tensor, as gloo takes them
dist.all_reduce(host)
show("all_reduce of a host tensor", host)
dist.barrier()
say(f"backend as the script named it: {dist.get_backend() == ('nccl' if bridged else 'gloo')}")
dist.destroy_process_group()
