"""Rank 1 leaves before the all_reduce that rank 0 calls: rank 0 must raise a timeout error
naming the collective and the missing rank, not hang (tests/test_distributed.py). With `crash`
after the timeout, rank 1 raises instead: its failure must end the run at once (the launcher
stops rank 0), not when the timeout or JAX's shutdown barrier gives up."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=float(sys.argv[1])))
rank = dist.get_rank()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
tensor = torch.ones(3, device="cuda")
dist.all_reduce(tensor)  # both ranks
if rank == 1 and sys.argv[2:] == ["crash"]:
    raise RuntimeError("rank 1 failed on purpose")
if rank == 1:
    time.sleep(float(sys.argv[1]) * 3)  # away (a crash, a hang elsewhere) for longer than the timeout
    sys.exit(0)
started = time.time()
try:
    dist.all_reduce(tensor)
except Exception as error:
    print(f"raised after {time.time() - started:.1f} s: {type(error).__module__}.{type(error).__name__}: {error}", flush=True)
    sys.exit(3)
print("all_reduce returned without rank 1", flush=True)
