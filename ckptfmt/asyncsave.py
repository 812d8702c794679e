"""``ckptfmt.asyncsave`` is now :mod:`ckptfmt.session.asyncsave`; this module keeps the public path working
(issue 25 item 6). New code imports ``ckptfmt.session.asyncsave``."""
from __future__ import annotations

from ckptfmt.session.asyncsave import SaveHandle as SaveHandle
from ckptfmt.session.asyncsave import save_async as save_async
from ckptfmt.session.asyncsave import save_in_flight as save_in_flight
from ckptfmt.session.asyncsave import start_async as start_async
from ckptfmt.session.asyncsave import RetrySchedule as RetrySchedule
from ckptfmt.session.asyncsave import run_attempts as run_attempts
from ckptfmt.session.asyncsave import HandBack as HandBack
from ckptfmt.session.asyncsave import copied_at_call as copied_at_call
