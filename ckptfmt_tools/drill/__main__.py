"""``python -m ckptfmt.drill``: the same as ``ckptfmt drill``."""
import sys

from ckptfmt.drill import main

if __name__ == "__main__":
    sys.exit(main())
