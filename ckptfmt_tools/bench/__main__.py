"""``python -m ckptfmt_tools.bench``: the benchmark without the ckptfmt CLI."""

import sys

from .args import main

sys.exit(main())
