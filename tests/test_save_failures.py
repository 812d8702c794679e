"""Save failures that do not end training (ckptfmt.manager.SaveFailurePolicy), with real faults.

* a full file system: a 4 MiB tmpfs filled by a file (ENOSPC in the middle of a save's writes);
* a read-only directory: the tmpfs remounted read-only (EROFS; a chmod would not do, since these
  tests may run as root, whom file modes do not stop);
* an S3 endpoint that goes away and comes back: a local moto server stopped and restarted.

The file-system faults run in ``tests/savefail_job.py`` inside ``unshare -Urm`` (a user and mount
namespace of its own, so the mounts need no privileges and vanish with the process); they skip
where the kernel allows no such namespace. In each, the storage fails for the saves of 3 steps in a
row, then recovers: training never stops, every failure is recorded, every later save commits, and
the newest committed step stays listed while the storage is broken. Each has a broken control: the
policy that raises after 2 failures in a row does raise, at the second.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

from ckptfmt import Box, Repository
from ckptfmt.errors import IncompleteSaveError, StorageError
from ckptfmt.manager import CheckpointManager, SaveFailurePolicy
from manager_common import TwoRankManager

HERE = Path(__file__).resolve().parent
BROKEN = [2, 3, 4]
LATER = [5, 6, 7, 8]


def _namespaces() -> bool:
    try:
        return subprocess.run(["unshare", "-Urm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_namespaces = pytest.mark.skipif(not _namespaces(), reason="no user/mount namespaces here (unshare -Urm)")


def _job(tmp_path: Path, *args: str) -> tuple[dict, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]),
               XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    out = subprocess.run(["unshare", "-Urm", sys.executable, str(HERE / "savefail_job.py"), str(tmp_path), *args],
                         capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def _check_survived(d: dict, log: str, attempts: int = 3) -> None:
    hist = {h["step"]: h for h in d["history"]}
    assert d["stopped"] is None and d["error"] is None, d["error"]  # training never stopped
    assert [s for s, h in hist.items() if not h["committed"]] == BROKEN
    assert all(hist[s]["committed"] and hist[s]["attempts"] == 1 for s in [1, *LATER])
    for s in BROKEN:  # each failure recorded: history, metrics file, log (the retries too)
        assert hist[s]["attempts"] == attempts and hist[s]["error"]
        assert f"step {s} was not committed after {attempts} attempt(s)" in log
        assert [e["attempt"] for e in d["events"] if e["event"] == "save_retry" and e["step"] == s] == \
            list(range(1, attempts))
        assert any(e["event"] == "save" and e["step"] == s and not e["committed"] for e in d["events"])
    assert d["listed_while_broken"] == [1]  # the newest committed step was kept, and listed
    assert d["steps"] == [7, 8] and d["restored"] == {"7": 7.0, "8": 8.0}  # keep_last=2 after recovery
    assert d["save_dirs"] == 2  # the failed saves left nothing behind


@needs_namespaces
@pytest.mark.parametrize("mode", [[], ["--blocking"]], ids=["async", "blocking"])
def test_full_file_system_for_three_saves_then_recovery(tmp_path, mode):
    d, log = _job(tmp_path, "--fault", "full", *mode)
    _check_survived(d, log)
    assert all("No space left on device" in h["error"] for h in d["history"] if not h["committed"])


@needs_namespaces
def test_full_file_system_control_policy_raises(tmp_path):
    d, _ = _job(tmp_path, "--fault", "full", "--fail-fast", "2")
    assert d["stopped"] == 3 and "No space left on device" in d["error"]  # raised at the 2nd failure in a row
    assert [h["committed"] for h in d["history"]] == [True, False, False]
    assert d["steps"] == [1] and d["restored"] == {"1": 1.0}


@needs_namespaces
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_read_only_directory_for_three_saves_then_recovery(tmp_path, framework):
    d, log = _job(tmp_path, "--fault", "ro", "--framework", framework)
    _check_survived(d, log)
    assert all("Read-only file system" in h["error"] for h in d["history"] if not h["committed"])


@needs_namespaces
def test_read_only_directory_control_policy_raises(tmp_path):
    d, _ = _job(tmp_path, "--fault", "ro", "--fail-fast", "2")
    assert d["stopped"] == 3 and "Read-only file system" in d["error"]
    assert d["steps"] == [1]


# ----------------------------------------------------------------- S3: the endpoint goes away and back


class _S3:
    """A moto server in this process (its buckets outlive a stop), on a port that stays the same."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        moto_server = pytest.importorskip("moto.server")
        boto3 = pytest.importorskip("boto3")
        from ckptfmt.coord import free_port

        self._cls, self.port = moto_server.ThreadedMotoServer, free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.bucket = f"ckpt-failures-{uuid.uuid4().hex[:8]}"  # moto's buckets live as long as this process
        self.url = f"s3://{self.bucket}/repo"
        self.server = None
        self.start()
        for var, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1"}.items():
            monkeypatch.setenv(var, value)
        for var in ("AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_DEFAULT_REGION"):
            monkeypatch.delenv(var, raising=False)
        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=self.bucket)

    def start(self) -> None:
        self.server = self._cls(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def repository(self) -> Repository:
        # One request retry inside tensorstore (the default's six would make each failure slow).
        fast = {"s3_request_retries": {"max_retries": 1, "initial_delay": "0.01s", "max_delay": "0.02s"}}
        return Repository(self.url, options={"kvstore": fast})


@pytest.fixture
def s3(monkeypatch):
    env = _S3(monkeypatch)
    yield env
    env.stop()


def _train_through_outage(s3: _S3, policy: SaveFailurePolicy) -> tuple[CheckpointManager, int | None, list]:
    m = CheckpointManager(s3.repository(), save_every_steps=1, failure_policy=policy)
    listed = None
    for step in range(1, 9):
        if step == BROKEN[0]:
            s3.stop()
        if step == LATER[0]:
            s3.start()
            listed = Repository(s3.url).steps()  # before any later save
        m.save(step, {"w": np.full((8, 8), step, np.float32)})
        m.wait()
    return m, listed, [h for h in m.history]


def test_s3_endpoint_down_for_three_saves_then_back(s3, caplog):
    caplog.set_level(logging.WARNING, logger="ckptfmt.manager")
    m, listed, hist = _train_through_outage(s3, SaveFailurePolicy(retries=1, backoff_s=0.01))
    m.close()  # the last save committed: close does not raise
    assert [h.step for h in hist if not h.committed] == BROKEN and all(h.attempts == 2 for h in hist if not h.committed)
    assert all(h.committed for h in hist if h.step not in BROKEN)
    assert all("StorageError" in h.error for h in hist if not h.committed)
    assert listed == [1]  # step 1 survived the outage
    assert Repository(s3.url).steps() == [1, *LATER]
    for s in BROKEN:
        assert any(f"step {s} was not committed after 2 attempt(s)" in r.getMessage() for r in caplog.records)


def test_s3_endpoint_down_control_fail_fast_raises(s3):
    m = CheckpointManager(s3.repository(), save_every_steps=1, failure_policy=SaveFailurePolicy.fail_fast())
    m.save(1, {"w": np.ones((8, 8), np.float32)})
    m.wait()
    s3.stop()
    m.save(2, {"w": np.ones((8, 8), np.float32)})
    with pytest.raises(StorageError):
        m.wait()
    assert [h.committed for h in m.history] == [True, False] and m.history[-1].attempts == 1
    m.close()  # already delivered: not raised again


def test_s3_outage_cured_by_a_retry_in_the_background(s3):
    """The endpoint comes back while the save waits for its retry: the same save commits, from the
    state staged at its call (the caller's arrays changed since)."""
    returned, seen = threading.Event(), []

    class Restart(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "save attempt 1 failed" in record.getMessage() and s3.server is None:
                # The retry waits here until save() has returned: a save() that waited for its own
                # retry would never return, and this would see the timeout instead.
                seen.append(returned.wait(30))
                s3.start()

    handler = Restart()
    logging.getLogger("ckptfmt.manager").addHandler(handler)
    try:
        m = CheckpointManager(s3.repository(), failure_policy=SaveFailurePolicy(retries=3, backoff_s=0.05))
        s3.stop()
        state = {"w": np.full((8, 8), 1, np.float32)}
        assert m.save(1, state, force=True)
        returned.set()
        state["w"][...] = 99  # training goes on and changes its arrays
        rec = m.wait()
        m.close()
    finally:
        logging.getLogger("ckptfmt.manager").removeHandler(handler)
    assert rec.committed and rec.attempts == 2
    assert seen == [True]  # the retry ran in the background, after save() returned
    r = Repository(s3.url)
    assert r.steps() == [1] and float(r.open(1).read("w", Box.full((8, 8)))[0, 0]) == 1.0


def test_close_raises_when_the_last_save_did_not_commit(s3):
    m = CheckpointManager(s3.repository(), failure_policy=SaveFailurePolicy(retries=0))
    m.save(1, {"w": np.ones((8, 8), np.float32)}, force=True)
    m.wait()
    s3.stop()
    m.save(2, {"w": np.ones((8, 8), np.float32)}, force=True)
    assert not m.wait().committed  # recorded, not raised
    with pytest.raises(StorageError):
        m.close()
    # control: the same without raise_at_close_if_uncommitted closes quietly
    s3.start()
    m = CheckpointManager(s3.repository(), failure_policy=SaveFailurePolicy(retries=0, raise_at_close_if_uncommitted=False))
    s3.stop()
    m.save(3, {"w": np.ones((8, 8), np.float32)}, force=True)
    m.close()
    assert not m.history[-1].committed


def test_policy_values():
    p = SaveFailurePolicy(retries=3, backoff_s=1.0, max_backoff_s=3.0)
    assert [p.delay_s(a) for a in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, None]
    assert not p.raises_after(4) and p.raises_after(5) and not SaveFailurePolicy(max_consecutive_failures=None).raises_after(99)
    assert p.retryable(StorageError("x")) and p.retryable(OSError(28, "full"))
    from ckptfmt.errors import InvalidStateError, StepAlreadyCommittedError
    assert not p.retryable(StepAlreadyCommittedError("x")) and not p.retryable(InvalidStateError("x"))
    for bad in (dict(retries=-1), dict(retries=True), dict(backoff_s=-1), dict(max_consecutive_failures=0)):
        with pytest.raises(ValueError):
            SaveFailurePolicy(**bad)
    with pytest.raises(ValueError):
        CheckpointManager("memory://x", failure_policy={"retries": 1})  # a misspelt dict is refused


# ----------------------------------------------------------------- two ranks: every rank retries alike


class _Rank(TwoRankManager):
    """Rank ``rank`` of 2: each saves rows [4r, 4r+4) of "w" through the retry schedule it is given."""

    def _save_verb(self, step, state, *, extra, metadata, rank_state, blocking, retry=None):
        from ckptfmt import LocalShard, save
        from ckptfmt.asyncsave import run_attempts

        w = state["w"][4 * self._r:4 * self._r + 4].copy()
        shard = LocalShard("w", (8, 4), w.dtype, Box((4 * self._r, 0), (4, 4)), w)
        manifest = run_attempts(lambda: save(self.repository, step, [shard], metadata=metadata,
                                             coordinator=self._save_coord), retry)
        return lambda: manifest


def _two_ranks(tmp_path, policy):
    """Rank 1's shard writes fail for the saves of steps 2 and 3 (a storage of its own that refuses
    them); each rank saves steps 1..5. (history per rank, error per rank, refused writes)."""
    from ckptfmt.coord import free_port
    from ckptfmt.storage import DelegatingStorage, open_storage

    url = str(tmp_path / "r")
    refused: list[str] = []

    class Refusing(DelegatingStorage):
        def write_object(self, key, buffers, *, tensor=None):
            if ("/t/" in key or "/p/" in key) and key.split("/")[1].startswith(("000000000002-", "000000000003-")):
                refused.append(key)
                raise StorageError("write refused (injected)", object=key)
            return super().write_object(key, buffers, tensor=tensor)

    addrs = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    out, errors = [None, None], [None, None]

    def run(rank):
        repo = Repository(url, storage=Refusing(open_storage(url)) if rank == 1 else None)
        m = _Rank(repo, rank, addrs, async_save=False, save_every_steps=1, failure_policy=policy)
        try:
            for step in range(1, 6):
                m.save(step, {"w": np.full((8, 4), step, np.float32)})
        except BaseException as e:  # noqa: BLE001
            errors[rank] = e
        finally:
            out[rank] = [(h.step, h.committed, h.attempts) for h in m.history]
            try:
                m.close()
            except BaseException:  # noqa: BLE001
                pass

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out, errors, refused, url


def test_two_ranks_retry_record_and_recover_alike(tmp_path):
    """Both ranks retry, record the same failures, and commit every later step."""
    out, errors, refused, url = _two_ranks(tmp_path, SaveFailurePolicy(retries=1, backoff_s=0.01))
    assert errors == [None, None], errors
    want = [(1, True, 1), (2, False, 2), (3, False, 2), (4, True, 1), (5, True, 1)]
    assert out == [want, want]
    assert len(refused) == 4  # 2 steps x 2 attempts, on rank 1 only
    assert Repository(url).steps() == [1, 4, 5]


def test_two_ranks_control_fail_fast_raises_on_every_rank(tmp_path):
    out, errors, refused, url = _two_ranks(tmp_path, SaveFailurePolicy.fail_fast())
    assert all(isinstance(e, IncompleteSaveError) and "write refused" in str(e) for e in errors), errors
    assert out == [[(1, True, 1), (2, False, 1)]] * 2 and len(refused) == 1
    assert Repository(url).steps() == [1]
