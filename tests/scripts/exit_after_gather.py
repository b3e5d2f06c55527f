"""Pairs of processes, one per rank (RANK, WORLD_SIZE, MASTER_ADDR set by the caller): each
makes a gloo group that a module-level reference keeps alive, as FSDP modules do, runs one
``all_gather_object``, then ``destroy_process_group`` and exits. With ``dcpkit`` the process has
used dcpkit with that group; without, it is the plain torch program.

    exit_after_gather.py dcpkit|torch PORT [PORT ...]

Each PORT is one pair: this process (torch, and dcpkit, imported once) forks the pair's
process, which sets up its group on that port, gathers and exits through the interpreter's own
finalization, as a program ends; its exit status (negative: the signal that ended it) is
printed, one line a pair: ``status N``.
"""

import os
import sys

import torch.distributed as torch_dist

if sys.argv[1] == "dcpkit":  # imported once, as a program does at its top
    from dcpkit import dist


def pair(mode: str, port: int) -> None:
    # The GIL is then given up only where the program waits, never on a timer: exiting right
    # after the gather is what this program does every time.
    sys.setswitchinterval(30)
    os.environ["MASTER_PORT"] = str(port)
    torch_dist.init_process_group("gloo")
    global GROUP
    GROUP = torch_dist.distributed_c10d._get_default_group()
    if mode == "dcpkit":
        assert dist.is_dist()
    out = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(out, ("x" * 1000, torch_dist.get_rank()))
    torch_dist.destroy_process_group()


for port in map(int, sys.argv[2:]):
    pid = os.fork()
    if pid == 0:
        pair(sys.argv[1], port)
        break  # the child ends here, as the one-pair program did
    _, status = os.waitpid(pid, 0)
    print(f"status {os.waitstatus_to_exitcode(status)}", flush=True)
