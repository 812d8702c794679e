"""``python -m ckptfmt_tools.faults [--json] [--workdir D] [--only NAME ...]``: same as ``ckptfmt faults``."""
import sys

from ckptfmt_tools.cli import main

if __name__ == "__main__":
    main(["faults", *sys.argv[1:]])
