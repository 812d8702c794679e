"""``python -m ckptfmt_tools.drill``: the same as ``ckptfmt drill``."""
import sys

from ckptfmt_tools.drill import main

if __name__ == "__main__":
    sys.exit(main())
