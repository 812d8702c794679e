"""Fresh-process runs and per-phase meters.

Every measured run happens in a new Python process, so that imports, caches
and allocator state of one run never help the next, and so that JAX can be
given its device count (``XLA_FLAGS``) before it is imported.

Parent side: :func:`run_child` starts a new interpreter (``_child_main``) with a
JSON task and returns the JSON the task wrote. Child side: the task is a
``"module:function"`` name called with its params dict; it measures its own
phases with :class:`Meter`.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

_PKG_ROOT = str(Path(__file__).resolve().parents[2])
_CHILD_MAIN = "import sys; from ckptfmt_tools.bench.child import _child_main; sys.exit(_child_main(sys.argv[1], sys.argv[2]))"


class ChildFailed(RuntimeError):
    """A benchmark child process failed; the message carries its traceback tail."""


# --------------------------------------------------------------------------- parent


def drop_page_cache() -> bool:
    """Flush dirty pages and drop the page cache. True if the drop worked (root on Linux)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_child(task: str, params: dict, *, env: dict[str, str] | None = None, timeout_s: float = 1800) -> dict:
    """Run ``task`` (``"module:function"``) in a fresh interpreter; return its result dict.

    On failure (non-zero exit, timeout, no result) raises :class:`ChildFailed`
    with the tail of the child's output; nothing is left running.
    """
    with tempfile.TemporaryDirectory(prefix="ckptfmt-bench-") as tmp:
        p_in, p_out = Path(tmp, "params.json"), Path(tmp, "result.json")
        p_in.write_text(json.dumps({"task": task, "params": params}))
        child_env = dict(os.environ)
        child_env["PYTHONPATH"] = os.pathsep.join(
            [_PKG_ROOT] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        child_env.update(env or {})
        t0 = time.perf_counter()
        # Own session, so that a timeout or Ctrl-C also ends the processes the child forked (DCP ranks).
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD_MAIN, str(p_in), str(p_out)],
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            output, _ = proc.communicate()
            raise ChildFailed(f"{task}: timed out after {timeout_s:.0f} s\n{_tail(output)}") from None
        except BaseException:
            _kill_group(proc)
            raise
        if not p_out.exists():
            raise ChildFailed(f"{task}: exit {proc.returncode}, no result\n{_tail(output)}")
        result = json.loads(p_out.read_text())
        if "error" in result:
            raise ChildFailed(f"{task}: {result['error']}\n{_tail(output)}")
        result["process_wall_s"] = time.perf_counter() - t0
        return result


def _kill_group(proc: subprocess.Popen) -> None:
    # Only called while the child is unreaped, so its pid (= the group id) cannot have been reused.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _tail(text: Any, n: int = 3000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-n:]


# --------------------------------------------------------------------------- child meters


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rss_bytes() -> int:
    """Current resident set size of this process."""
    try:
        return _status_kib("VmRSS") * 1024
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak_rss() -> bool:
    # Linux >= 4.0: writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    try:
        return _status_kib("VmHWM") * 1024
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _proc_io() -> dict[str, int]:
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f)}
    except OSError:
        return {}


def _ts_file_metrics() -> dict[str, int]:
    ts = sys.modules.get("tensorstore")
    if ts is None:
        return {}
    out = {}
    for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/"):
        v = m["values"][0] if m.get("values") else {}
        if "value" in v:
            out[m["name"]] = int(v["value"])
    return out


# kvstore drivers that touch storage; layered drivers (ocdbt, zip, ...) would count the same bytes twice.
_STORAGE_DRIVERS = ("file", "s3", "gcs", "gcs_grpc", "http")


def _storage_sum(delta: dict[str, int], metric: str) -> int:
    return sum(v for k, v in delta.items() if k.split("/")[0] in _STORAGE_DRIVERS and k.split("/")[1] == metric)


class Meter:
    """Wall time, peak RSS, syscall I/O and tensorstore kvstore I/O of one phase.

    ``rss_before`` is the resident set when the phase starts; ``rss_peak`` the
    highest resident set during the phase (the kernel's high-water mark, reset
    at the start, so it misses nothing).
    """

    def __init__(self, name: str):
        self.name = name
        self.result: dict[str, Any] = {}

    def __enter__(self) -> "Meter":
        self._rss0 = rss_bytes()
        self._reset = _reset_peak_rss()
        self._io0 = _proc_io()
        self._ts0 = _ts_file_metrics()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._t0
        io1, ts1 = _proc_io(), _ts_file_metrics()
        ts_delta = {k.rsplit("/", 2)[-2] + "/" + k.rsplit("/", 1)[-1]: v - self._ts0.get(k, 0) for k, v in ts1.items()}
        self.result = {
            "wall_s": wall,
            "rss_before": self._rss0,
            "rss_peak": _peak_rss_bytes(),
            "rss_peak_exact": self._reset,
            "io_rchar": io1.get("rchar", 0) - self._io0.get("rchar", 0),
            "io_wchar": io1.get("wchar", 0) - self._io0.get("wchar", 0),
            "io_read_bytes": io1.get("read_bytes", 0) - self._io0.get("read_bytes", 0),
            "io_write_bytes": io1.get("write_bytes", 0) - self._io0.get("write_bytes", 0),
            "ts_bytes_read": _storage_sum(ts_delta, "bytes_read"),
            "ts_bytes_written": _storage_sum(ts_delta, "bytes_written"),
            "ts_reads": _storage_sum(ts_delta, "read"),
        }


def sync_after() -> float:
    """Seconds a system-wide sync takes right after a save: ~0 when the save left nothing unflushed."""
    t0 = time.perf_counter()
    os.sync()
    return time.perf_counter() - t0


def tree_stats(path: str | os.PathLike) -> dict[str, int]:
    """Objects (files) and logical bytes under a directory."""
    files = nbytes = 0
    for root, _dirs, names in os.walk(path):
        for n in names:
            try:
                nbytes += os.stat(os.path.join(root, n)).st_size
                files += 1
            except OSError:
                pass
    return {"objects": files, "bytes_on_disk": nbytes}


def _child_main(p_in: str, p_out: str) -> int:
    spec = json.loads(Path(p_in).read_text())
    try:
        mod_name, fn_name = spec["task"].split(":")
        fn = getattr(importlib.import_module(mod_name), fn_name)
        result = fn(spec["params"])
    except BaseException:  # report anything, including SystemExit from a library
        result = {"error": traceback.format_exc()[-4000:]}
    tmp = p_out + ".tmp"
    Path(tmp).write_text(json.dumps(result))
    os.replace(tmp, p_out)
    return 0 if "error" not in result else 1

