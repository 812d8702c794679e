"""kvstore_spec: repository URL + environment + options -> tensorstore kvstore spec. Pure and fast."""
from __future__ import annotations

import os

import pytest
import tensorstore as ts

from ckptfmt.storage._kvurl import S3_DEFAULT_RETRIES
from ckptfmt.storage._kvurl import kvstore_spec as _kvstore_spec


def kvstore_spec(*a, **kw):
    """The spec minus the default S3 retry policy (checked once in test_s3_default_retries)."""
    spec = _kvstore_spec(*a, **kw)
    if spec.get("s3_request_retries") == S3_DEFAULT_RETRIES:
        spec.pop("s3_request_retries")
    return spec


def test_s3_default_retries_bounded_and_overridable():
    assert _kvstore_spec("s3://b/p", environ={})["s3_request_retries"] == S3_DEFAULT_RETRIES
    custom = {"max_retries": 1}
    assert _kvstore_spec("s3://b/p", {"s3_request_retries": custom}, environ={})["s3_request_retries"] == custom
from ckptfmt.errors import CheckpointError, InvalidURLError

S3_ENV = {"AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "secret",
          "AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_REGION": "eu-west-1"}


# ---------------------------------------------------------------- local schemes
def test_local_path_is_absolute_file_driver(tmp_path):
    assert kvstore_spec(str(tmp_path / "repo")) == {"driver": "file", "path": str(tmp_path / "repo") + "/"}
    rel = kvstore_spec("some/rel/")
    assert rel["path"] == os.path.abspath("some/rel") + "/"


def test_file_url():
    assert kvstore_spec("file:///data/ckpt/") == {"driver": "file", "path": "/data/ckpt/"}
    assert kvstore_spec("file:///data/ckpt") == {"driver": "file", "path": "/data/ckpt/"}


def test_memory_url():
    assert kvstore_spec("memory://run1") == {"driver": "memory", "path": "run1/"}
    assert kvstore_spec("memory://") == {"driver": "memory", "path": ""}


def test_unknown_scheme_is_a_checkpoint_error():
    with pytest.raises(InvalidURLError, match="unsupported repository URL scheme") as e:
        kvstore_spec("ftp://host/x")
    assert e.value.object == "ftp://host/x" and "file:///" in e.value.expected
    assert isinstance(e.value, CheckpointError)


# Each ambiguous URL next to the accepted spelling of what it probably meant (the broken control:
# the check refuses the first and accepts the second).
AMBIGUOUS = [
    ("file:/abs/dir", "file:///abs/dir", "needs '//'"),          # was the directory ./file:/abs/dir
    ("file:rel/dir", "rel/dir", "needs '//'"),
    ("file://rel/dir", "file:///rel/dir", "names the host 'rel'"),  # was /rel/dir: 'rel' is a host
    ("file://example.com/x", "file://localhost/x", "names the host"),
    ("file://", "file:///", "names no path"),
    ("file:///a%20b", "/a%20b", "percent-decoded"),
    ("file:///a?b", "/a?b", "query or fragment"),
    ("memory:/x", "memory://x", "needs '//'"),                   # was the directory ./memory:/x
    ("memory:x", "memory://x", "needs '//'"),
    ("s3:bucket/p", "s3://bucket/p", "needs '//'"),
    ("gs:/bucket", "gs://bucket", "needs '//'"),
    ("ckpt:v1", "./ckpt:v1", r"unsupported repository URL scheme 'ckpt' .*written \./ckpt:v1"),
    ("c:/data", "/data", "unsupported repository URL scheme 'c'"),
    ("data/run://x", "data/run/x", "must not contain '://'"),
    ("", ".", "empty"),
]


@pytest.mark.parametrize("bad,good,match", AMBIGUOUS, ids=[a[0] or "<empty>" for a in AMBIGUOUS])
def test_ambiguous_urls_are_refused_and_their_plain_spelling_accepted(bad, good, match):
    with pytest.raises(InvalidURLError, match=match) as e:
        kvstore_spec(bad, environ={})
    assert e.value.object == bad and e.value.expected  # names the URL and what was expected
    assert kvstore_spec(good, environ={})["driver"] in ("file", "memory", "s3", "gcs")


def test_file_url_forms():
    assert kvstore_spec("file://localhost/data/ckpt") == {"driver": "file", "path": "/data/ckpt/"}
    assert kvstore_spec("FILE:///data/ckpt")["path"] == "/data/ckpt/"  # schemes are case-insensitive
    assert kvstore_spec("file:///data/./x/../ckpt//")["path"] == "/data/ckpt/"
    assert kvstore_spec("file:///")["path"] == "/"
    assert kvstore_spec("./ckpt:v1")["path"] == os.path.abspath("ckpt:v1") + "/"


def test_home_is_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert kvstore_spec("~/ckpt")["path"] == str(tmp_path / "ckpt") + "/"
    assert kvstore_spec("~")["path"] == str(tmp_path) + "/"
    import pwd
    me = pwd.getpwuid(os.getuid())
    assert kvstore_spec(f"~{me.pw_name}/ckpt")["path"] == os.path.join(me.pw_dir, "ckpt") + "/"
    with pytest.raises(InvalidURLError, match="no home directory") as e:
        kvstore_spec("~no-such-user-ckptfmt/x")
    assert e.value.object == "~no-such-user-ckptfmt/x"


def test_ambiguous_urls_create_nothing_in_the_current_directory(monkeypatch, tmp_path):
    # End to end through Repository and a real save: before the fix each of these wrote a
    # directory under the current directory (or at /rel/dir).
    import numpy as np

    import ckptfmt
    from ckptfmt._types import Box, LocalShard

    work, home = tmp_path / "cwd", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    x = np.arange(4, dtype=np.float32)
    shards = [LocalShard("x", (4,), x.dtype, Box.full((4,)), x)]
    for bad in (f"file:{tmp_path}/a", "memory:/x", "file://rel/dir"):
        with pytest.raises(InvalidURLError):
            ckptfmt.save(bad, 1, shards)
    assert list(work.iterdir()) == []
    ckptfmt.save("~/run", 1, shards)  # the control: ~ lands in $HOME
    assert ckptfmt.Repository(str(home / "run")).steps() == [1] and list(work.iterdir()) == []


def test_options_must_be_a_mapping():
    with pytest.raises(CheckpointError, match="mapping"):
        kvstore_spec("s3://b/p", ["endpoint"], environ={})  # type: ignore[arg-type]


# ---------------------------------------------------------------- s3
def test_s3_bare_environment_uses_default_chain():
    # No AWS_* at all: no endpoint, no region, no credentials member -> tensorstore's defaults
    # (the default credential chain, the region found from the bucket).
    assert kvstore_spec("s3://bucket/run/1", environ={}) == {"driver": "s3", "bucket": "bucket", "path": "run/1/"}


def test_s3_bucket_only_and_slashes():
    assert kvstore_spec("s3://bucket", environ={})["path"] == ""
    assert kvstore_spec("s3://bucket/", environ={})["path"] == ""
    assert kvstore_spec("s3://bucket/a/b/", environ={})["path"] == "a/b/"


def test_s3_without_bucket_is_rejected():
    with pytest.raises(InvalidURLError, match="no bucket"):
        kvstore_spec("s3:///prefix", environ={})
    with pytest.raises(InvalidURLError, match="no bucket"):
        kvstore_spec("gs://", environ={})


def test_s3_environment_is_read():
    spec = kvstore_spec("s3://bucket/p", environ=S3_ENV)
    assert spec == {"driver": "s3", "bucket": "bucket", "path": "p/", "endpoint": "http://127.0.0.1:9000",
                    "aws_region": "eu-west-1", "aws_credentials": {"type": "environment"}}


def test_s3_service_specific_endpoint_wins():
    env = dict(S3_ENV, AWS_ENDPOINT_URL_S3="http://s3.local:1")
    assert kvstore_spec("s3://b/p", environ=env)["endpoint"] == "http://s3.local:1"


def test_s3_ignore_configured_endpoints():
    env = dict(S3_ENV, AWS_ENDPOINT_URL_S3="http://s3.local:1", AWS_IGNORE_CONFIGURED_ENDPOINT_URLS="true")
    assert "endpoint" not in kvstore_spec("s3://b/p", environ=env)


def test_s3_region_precedence():
    assert kvstore_spec("s3://b", environ={"AWS_DEFAULT_REGION": "us-west-2"})["aws_region"] == "us-west-2"
    env = {"AWS_REGION": "eu-central-1", "AWS_DEFAULT_REGION": "us-west-2"}
    assert kvstore_spec("s3://b", environ=env)["aws_region"] == "eu-central-1"


def test_s3_credentials_only_from_access_key():
    # A secret without a key id is not a credential set: leave the default chain in charge.
    assert "aws_credentials" not in kvstore_spec("s3://b", environ={"AWS_SECRET_ACCESS_KEY": "x"})
    assert "aws_credentials" not in kvstore_spec("s3://b", environ={"AWS_ACCESS_KEY_ID": ""})
    assert kvstore_spec("s3://b", environ={"AWS_ACCESS_KEY_ID": "k"})["aws_credentials"] == {"type": "environment"}


def test_s3_options_override_environment():
    opts = {"endpoint": "https://minio.internal:9000", "region": "auto", "host_header": "minio.internal",
            "profile": "ckpt", "requester_pays": True}
    spec = kvstore_spec("s3://b/p", opts, environ=S3_ENV)
    assert spec == {"driver": "s3", "bucket": "b", "path": "p/", "endpoint": "https://minio.internal:9000",
                    "aws_region": "auto", "host_header": "minio.internal", "requester_pays": True,
                    "aws_credentials": {"type": "profile", "profile": "ckpt"}}


def test_s3_option_aliases_and_credentials_forms():
    spec = kvstore_spec("s3://b", {"endpoint_url": "http://e:1", "aws_region": "r", "credentials": "anonymous"},
                        environ=S3_ENV)
    assert (spec["endpoint"], spec["aws_region"], spec["aws_credentials"]) == ("http://e:1", "r", {"type": "anonymous"})
    full = {"type": "profile", "profile": "p", "credentials_file": "/etc/creds"}
    assert kvstore_spec("s3://b", {"credentials": full}, environ={})["aws_credentials"] == full
    # None means "not given": the environment still applies.
    assert kvstore_spec("s3://b", {"endpoint": None}, environ=S3_ENV)["endpoint"] == S3_ENV["AWS_ENDPOINT_URL"]


def test_s3_spec_is_accepted_by_tensorstore():
    # Spec parsing only (no request is made until an operation runs).
    spec = kvstore_spec("s3://bucket/p", {"host_header": "h"}, environ=S3_ENV)
    assert ts.KvStore.Spec(spec).to_json()["bucket"] == "bucket"


def test_environ_defaults_to_process_environment(monkeypatch):
    for k in ("AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://from-env:1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    spec = kvstore_spec("s3://b/p")
    assert spec["endpoint"] == "http://from-env:1" and spec["aws_credentials"] == {"type": "environment"}


# ---------------------------------------------------------------- gcs
def test_gs_url_same_path_rules_and_ignores_aws_environment():
    assert kvstore_spec("gs://bucket/a/b", environ=S3_ENV) == {"driver": "gcs", "bucket": "bucket", "path": "a/b/"}
    assert kvstore_spec("gs://bucket", {"user_project": "proj"}, environ={}) == {
        "driver": "gcs", "bucket": "bucket", "path": "", "user_project": "proj"}
    assert ts.KvStore.Spec(kvstore_spec("gs://bucket/x", environ={})).to_json()["driver"] == "gcs"
