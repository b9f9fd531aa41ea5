"""`eaglespec.train` under torchrun, recording what each rank ends with (for test_train_loop).

Run as `python -m torch.distributed.run --nproc-per-node 2 tests/ddp_worker.py <train args>`.
It runs the real command line (cli.main); two hooks only observe:
  - loop.collate records the sample ids of every batch this rank trains on;
  - loop.train, once it returns, saves this rank's head parameters, batches and step count to
    <out>/rank<RANK>.pt.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

from eaglespec.train import cli, loop


def main(argv: list[str]) -> int:
    # Never outlive the test, even if a collective hangs (SIGALRM's default action ends the process).
    signal.alarm(int(os.environ.get("DDP_WORKER_ALARM", "150")))
    out = Path(argv[argv.index("--out") + 1])
    rank = int(os.environ.get("RANK", "0"))
    batches: list[list[int]] = []

    real_collate, real_train = loop.collate, loop.train

    def collate(store, ids, device):
        batches.append([int(i) for i in ids])
        return real_collate(store, ids, device)

    def train(head, *args, **kwargs):
        state = real_train(head, *args, **kwargs)
        params = {k: v.detach().cpu().clone() for k, v in head.state_dict().items()}
        torch.save({"params": params, "batches": batches, "step": state.step}, out / f"rank{rank}.pt")
        return state

    loop.collate, loop.train = collate, train  # cmd_train imports loop.train at call time
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
