import sys

from dcpkit.train.trainer import main

if __name__ == "__main__":
    sys.exit(main())
