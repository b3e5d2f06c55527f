"""Two processes (RANK, WORLD_SIZE, MASTER_ADDR/PORT set by the caller): a gloo group that a
module-level reference keeps alive, as FSDP modules do, one ``all_gather_object``, then
``destroy_process_group`` and exit. With ``dcpkit`` the process has used dcpkit with that
group; without, it is the plain torch program.

    exit_after_gather.py dcpkit|torch
"""

import sys

import torch.distributed as torch_dist

# The GIL is then given up only where the program waits, never on a timer: exiting right
# after the gather is what this program does every time.
sys.setswitchinterval(30)
torch_dist.init_process_group("gloo")
GROUP = torch_dist.distributed_c10d._get_default_group()
if sys.argv[1] == "dcpkit":
    from dcpkit import dist

    assert dist.is_dist()
out = [None] * torch_dist.get_world_size()
torch_dist.all_gather_object(out, ("x" * 1000, torch_dist.get_rank()))
torch_dist.destroy_process_group()
