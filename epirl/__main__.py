"""`python -m epirl ...` = the `epirl` command; what `torchrun ... -m epirl train RECIPE` runs on each rank."""

import sys

from epirl.cli import main

if __name__ == "__main__":
    sys.exit(main())
