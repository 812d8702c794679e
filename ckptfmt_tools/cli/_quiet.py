"""The AWS SDK's log, quiet unless asked (issue 52).

tensorstore's S3 driver routes the AWS C libraries' log into absl's C++ log, which writes to file
descriptor 2 at WARNING and above whatever Python does: a failed credentials lookup printed five
``E1206 ... common-io:5] ...`` lines before the command's own error. The command line therefore
points descriptor 2 at a pipe while it runs, keeps Python's ``sys.stderr`` on the real stderr (so
rich still sees the terminal), and copies every line from the pipe to the real stderr except an
absl line from an AWS log subject (its "file" is an AWS subject name such as ``common-io`` or
``AuthCredentialsProvider``, not a C++ source file). ``CKPTFMT_AWS_LOG=1``, or
``TENSORSTORE_VERBOSE_LOGGING`` naming ``aws``, shows them all.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from typing import Iterator

__all__ = ["quiet_aws_log", "is_aws_line", "AWS_LOG_ENV"]

AWS_LOG_ENV = "CKPTFMT_AWS_LOG"
#: absl's prefix: severity, MMDD, time, thread id, "file:line]".
_ABSL = re.compile(rb"^[IWEF]\d{4} [\d:.]+ +\d+ (?P<file>[^:\]\s]+):\d+\] ")


def is_aws_line(line: bytes) -> bool:
    """Whether ``line`` is an absl log line from an AWS log subject (not from a C++ source file)."""
    m = _ABSL.match(line)
    if m is None:
        return False
    name = m.group("file")
    return name == b"aws_api.cc" or not name.endswith((b".cc", b".h", b".cpp", b".c"))


def _asked() -> bool:
    return os.environ.get(AWS_LOG_ENV, "") not in ("", "0") or "aws" in os.environ.get("TENSORSTORE_VERBOSE_LOGGING", "")


@contextlib.contextmanager
def quiet_aws_log() -> Iterator[None]:
    """While the body runs, drop the AWS SDK's absl lines from descriptor 2 (see the module
    docstring); every other byte written there reaches stderr, in order. Does nothing when the
    log was asked for or descriptor 2 cannot be redirected."""
    if _asked():
        yield
        return
    try:
        sys.stderr.flush()
        real = os.dup(2)
        r, w = os.pipe()
    except OSError:
        yield
        return
    saved_stderr = sys.stderr
    sys.stderr = os.fdopen(os.dup(real), "w", buffering=1, encoding=saved_stderr.encoding or "utf-8",
                           errors=getattr(saved_stderr, "errors", None) or "backslashreplace")

    def pump() -> None:
        pending = b""
        while True:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not is_aws_line(line):
                    os.write(real, line + b"\n")
        if pending and not is_aws_line(pending):
            os.write(real, pending)

    thread = threading.Thread(target=pump, name="ckptfmt-stderr-filter", daemon=True)
    thread.start()
    os.dup2(w, 2)
    os.close(w)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(real, 2)  # closes the pipe's last write end: the pump drains and ends
        thread.join(timeout=5)
        os.close(r)
        replaced, sys.stderr = sys.stderr, saved_stderr
        with contextlib.suppress(Exception):
            replaced.close()
        os.close(real)
