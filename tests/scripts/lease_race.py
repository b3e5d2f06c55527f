"""A run's start on a store that answers slowly: takes FOLDER's lease, the store's reachability
check and listings answered DELAY seconds late, as a busy bucket's are (its reads and writes
at their own speed). Prints ``WON RUN_ID`` once it holds the lease (and holds it until a line
comes on stdin), or ``REFUSED MESSAGE``.

    lease_race.py FOLDER DELAY
"""

import sys
import time

from dcpkit import CheckpointError
from dcpkit.engine.lease import Lease
from dcpkit.storage import open_store

folder, delay = sys.argv[1], float(sys.argv[2])
store = open_store(folder)
for name in ("check_reachable", "list_names"):
    slow = getattr(store, name)

    def late(*args, _slow=slow, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(delay)
        return _slow(*args, **kwargs)

    setattr(store, name, late)
lease = Lease(store, timeout_s=60)
try:
    lease.acquire()
except CheckpointError as e:
    print(f"REFUSED {e}", flush=True)
    sys.exit(0)
print(f"WON {lease.record['run_id']}", flush=True)
sys.stdin.readline()
lease.release()
