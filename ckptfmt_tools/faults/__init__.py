"""Fault injection: one fault per run against a real multi-writer save, and the outcome table.

``python -m ckptfmt.faults`` (or ``ckptfmt faults``) runs the whole catalogue and prints one
row per fault: where it was injected, the error raised, whether any wrong value reached the
caller, whether the prior checkpoint is intact, and whether gc left the repository clean.
"""
from __future__ import annotations

from ckptfmt.faults._catalogue import CATALOGUE as CATALOGUE
from ckptfmt.faults._catalogue import Fault as Fault
from ckptfmt.faults._catalogue import by_name as by_name
from ckptfmt.faults._fixture import Context as Context
from ckptfmt.faults._fixture import Outcome as Outcome
from ckptfmt.faults._fixture import OutcomeTable as OutcomeTable
from ckptfmt.faults._fixture import build_base as build_base
from ckptfmt.faults._fixture import run_all as run_all
from ckptfmt.faults._fixture import run_fault as run_fault
from ckptfmt.faults._table import print_table as print_table
from ckptfmt.faults._table import to_markdown as to_markdown

__all__ = ["CATALOGUE", "Fault", "by_name", "Context", "Outcome", "OutcomeTable", "build_base", "run_all",
           "run_fault", "print_table", "to_markdown"]
