"""Fault injection: one fault per run against a real multi-writer save, and the outcome table.

``python -m ckptfmt_tools.faults`` (or ``ckptfmt faults``) runs the whole catalogue and prints one
row per fault: where it was injected, the error raised, whether any wrong value reached the
caller, whether the prior checkpoint is intact, and whether gc left the repository clean.
"""
from __future__ import annotations

from ckptfmt_tools.faults._catalogue import CATALOGUE as CATALOGUE
from ckptfmt_tools.faults._catalogue import Fault as Fault
from ckptfmt_tools.faults._catalogue import by_name as by_name
from ckptfmt_tools.faults._fixture import Context as Context
from ckptfmt_tools.faults._fixture import Outcome as Outcome
from ckptfmt_tools.faults._fixture import OutcomeTable as OutcomeTable
from ckptfmt_tools.faults._fixture import build_base as build_base
from ckptfmt_tools.faults._fixture import run_all as run_all
from ckptfmt_tools.faults._fixture import run_fault as run_fault
from ckptfmt_tools.faults._table import print_table as print_table
from ckptfmt_tools.faults._table import to_markdown as to_markdown

__all__ = ["CATALOGUE", "Fault", "by_name", "Context", "Outcome", "OutcomeTable", "build_base", "run_all",
           "run_fault", "print_table", "to_markdown"]
