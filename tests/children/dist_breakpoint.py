"""A two-rank gloo job that stops in ``torch.distributed.breakpoint(rank=1)``.

Run by ``aioelastic-run --nproc-per-node 2`` under a pseudo-terminal
(tests/core/output/test_terminal_keyboard.py): rank 1 enters torch's debugger, which reads
``open("/dev/stdin")``, while rank 0 waits in the barrier after it; both finish with an
all-reduce once the session continues.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    secret = torch.tensor([7.0 * (rank + 1)])
    dist.breakpoint(rank=1)
    total = secret.clone()
    dist.all_reduce(total)
    print(f"rank {rank} sum {total.item():g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
