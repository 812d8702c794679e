"""``python -m ckptfmt``: the same command line as the ``ckptfmt`` console script."""
from ckptfmt.cli import main

if __name__ == "__main__":
    main()
