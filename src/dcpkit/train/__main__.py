import os
import sys

from dcpkit.train.trainer import main

if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter finalization. The process groups are destroyed by now, but
    # objects that still refer to them (device meshes, DTensors) would be torn down there in
    # arbitrary order, and gloo's threads can then abort a run that finished cleanly
    # ("terminate called without an active exception").
    os._exit(code)
