"""``python -m ckptfmt`` and the ``ckptfmt`` console script: a thin entry point to the tools' CLI.

The command line lives in :mod:`ckptfmt_tools.cli` (typer and rich, the ``cli`` extra). It is
imported only when the command runs, never by ``import ckptfmt``; when typer or rich is missing
this says which extra to install instead of printing a traceback.
"""
from __future__ import annotations

import sys

CLI_EXTRA_HINT = "the ckptfmt command line needs typer and rich: pip install 'ckptfmt[cli]'"


def main(argv: list[str] | None = None) -> None:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``). Exits 2 with an install hint
    when the ``cli`` extra is missing; otherwise exits as the command does."""
    try:
        from ckptfmt_tools.cli import main as cli_main
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in ("typer", "rich"):
            raise
        sys.stderr.write(f"{CLI_EXTRA_HINT} (missing: {e.name})\n")
        raise SystemExit(2) from None
    cli_main(argv)


if __name__ == "__main__":
    main()
