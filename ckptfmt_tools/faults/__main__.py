"""``python -m ckptfmt.faults [--json] [--workdir D] [--only NAME ...]``: same as ``ckptfmt faults``."""
import sys

from ckptfmt.cli import main

if __name__ == "__main__":
    main(["faults", *sys.argv[1:]])
