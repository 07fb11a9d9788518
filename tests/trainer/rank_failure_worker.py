"""Worker of tests/trainer/test_rank_failure.py, run under ``torchrun --nproc_per_node 2``.

Both ranks enter :func:`trainer.distributed.run_on_ranks`, whose work is one collective (the
learner's finite vote is an ``all_reduce`` like it). Rank 1 fails before it: ``--mode raise``
raises, as a rank does on an out-of-memory error or a local disk error; ``--mode stall`` sleeps
past the test, as a rank does whose GPU or node froze. Rank 0 waits in the collective.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from trainer.distributed import DistContext, run_on_ranks

STALL_S = 600.0
"""How long a stalled rank sleeps: longer than the test waits, so only the collective timeout ends the job."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["raise", "stall"], required=True)
    parser.add_argument("--timeout-s", type=float, default=None)
    args = parser.parse_args()

    def work(ctx: DistContext) -> float:
        if ctx.rank == 1:
            if args.mode == "raise":
                raise RuntimeError("injected failure on rank 1")
            time.sleep(STALL_S)
        vote = torch.ones(1)
        dist.all_reduce(vote)
        return float(vote)

    run_on_ranks(work, args.timeout_s)


if __name__ == "__main__":
    main()
