"""Repository URL -> tensorstore kvstore spec.

One function, ``kvstore_spec``, turns a repository URL into the JSON spec that
``tensorstore.KvStore.open`` takes. Everything above this module works on keys
relative to that kvstore, so file, memory, S3 and GCS share one code path.

Supported URLs:

=========================  ==============================================
``/abs/path``, ``rel/path``  local filesystem (``file`` driver)
``file:///abs/path``        local filesystem
``memory://name``           in-process memory (tests)
``s3://bucket[/prefix]``    S3 or any S3-compatible store (``s3`` driver)
``gs://bucket[/prefix]``    Google Cloud Storage (``gcs`` driver)
=========================  ==============================================

S3 settings are read from the environment the way boto3 and the AWS CLI read
them, and explicit ``options`` win over the environment:

- endpoint: ``AWS_ENDPOINT_URL_S3``, then ``AWS_ENDPOINT_URL`` (both ignored when
  ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS`` is true) -> ``"endpoint"``;
- region: ``AWS_REGION``, then ``AWS_DEFAULT_REGION`` -> ``"aws_region"``;
- credentials: ``{"type": "environment"}`` when ``AWS_ACCESS_KEY_ID`` is set
  (with ``AWS_SECRET_ACCESS_KEY`` and optional ``AWS_SESSION_TOKEN``); otherwise
  tensorstore's default chain (profile files, ``AWS_PROFILE``, ECS, EC2 IMDS).

GCS needs nothing here: tensorstore reads ``GOOGLE_APPLICATION_CREDENTIALS`` and
the gcloud default credentials itself.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from .errors import InvalidManifestError

__all__ = ["kvstore_spec"]

# Short option names accepted for s3:// repositories, mapped onto the s3 driver's spec members.
# Any other option is passed to tensorstore unchanged (so every driver member and context
# resource, e.g. "requester_pays" or "s3_request_concurrency", works without a change here).
_S3_ALIASES = {"region": "aws_region", "endpoint_url": "endpoint"}


#: Default retry policy for s3:// repositories (override with the ``s3_request_retries`` option).
S3_DEFAULT_RETRIES = {"max_retries": 6, "initial_delay": "0.1s", "max_delay": "2s"}


def kvstore_spec(url: str, options: Mapping[str, Any] | None = None, *,
                 environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Return the tensorstore kvstore spec (a JSON dict) for a repository URL.

    ``options`` override what the URL and the environment give; for ``s3://`` they may use
    ``endpoint`` (or ``endpoint_url``), ``region`` (or ``aws_region``), ``host_header``,
    ``requester_pays``, ``profile`` (an AWS profile name -> profile credentials) and
    ``credentials`` (a credentials type such as ``"anonymous"``, or a full
    ``aws_credentials`` object). ``environ`` defaults to ``os.environ`` (tests pass their own).

    The path always ends with "/" (or is empty) so that keys are appended beneath it.
    Pure: opens nothing. Raises InvalidManifestError (a CheckpointError) for an unknown
    scheme, a missing bucket, or options that are not a mapping.
    """
    env = os.environ if environ is None else environ
    opts = _check_options(url, options)
    if "://" not in url:
        spec: dict[str, Any] = {"driver": "file", "path": os.path.abspath(url).rstrip("/") + "/"}
        return _merge(spec, opts)
    scheme, rest = url.split("://", 1)
    if scheme == "file":
        return _merge({"driver": "file", "path": "/" + rest.lstrip("/").rstrip("/") + "/"}, opts)
    if scheme == "memory":
        return _merge({"driver": "memory", "path": _prefix(rest)}, opts)
    if scheme in ("s3", "gs"):
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise InvalidManifestError("repository URL names no bucket", object=url,
                                       expected=f"{scheme}://bucket/prefix", found=url)
        if scheme == "gs":
            return _merge({"driver": "gcs", "bucket": bucket, "path": _prefix(prefix)}, opts)
        return _s3_spec(bucket, _prefix(prefix), opts, env)
    raise InvalidManifestError(
        f"unsupported repository URL scheme {scheme!r}", object=url,
        expected="a local path, file://, memory://, s3:// or gs://", found=scheme)


def _s3_spec(bucket: str, path: str, opts: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": path}
    if not _truthy(env.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")):
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        if endpoint:
            spec["endpoint"] = endpoint
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    if env.get("AWS_ACCESS_KEY_ID"):
        spec["aws_credentials"] = {"type": "environment"}

    opts = {_S3_ALIASES.get(k, k): v for k, v in opts.items()}
    profile = opts.pop("profile", None)
    credentials = opts.pop("credentials", None)
    if credentials is not None:
        spec["aws_credentials"] = {"type": credentials} if isinstance(credentials, str) else dict(credentials)
    elif profile is not None:
        spec["aws_credentials"] = {"type": "profile", "profile": str(profile)}
    # tensorstore's default (32 attempts, backoff to 32 s) takes ~15 minutes to give up on an
    # unreachable endpoint; fail closed within seconds instead. Callers may override it.
    spec["s3_request_retries"] = dict(S3_DEFAULT_RETRIES)
    return _merge(spec, opts)


def _check_options(url: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise InvalidManifestError("storage options must be a mapping", object=url,
                                   expected="dict", found=type(options).__name__)
    return {str(k): v for k, v in options.items() if v is not None}


def _merge(spec: dict[str, Any], opts: Mapping[str, Any]) -> dict[str, Any]:
    spec.update(opts)
    return spec


def _prefix(rest: str) -> str:
    rest = rest.strip("/")
    return rest + "/" if rest else ""


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")
