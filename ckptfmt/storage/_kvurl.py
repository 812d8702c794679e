"""Repository URL -> tensorstore kvstore spec.

One function, ``kvstore_spec``, turns a repository URL into the JSON spec that
``tensorstore.KvStore.open`` takes. Everything above this module works on keys
relative to that kvstore, so file, memory, S3 and GCS share one code path.

Accepted URLs (spec/FORMAT.md 4.1). A string that begins with ``<scheme>:`` (a letter, then
letters, digits, ``+``, ``-`` or ``.``) is a URL; anything else is a local path.

==============================  ================================================
``/abs/path``, ``rel/path``     local filesystem (``file`` driver); a relative path is
                                resolved against the current directory
``~/path``, ``~user/path``      local filesystem under that user's home directory
``file:///abs/path``            local filesystem (empty authority)
``file://localhost/abs/path``   the same
``memory://name``, ``memory://``  in-process memory (tests)
``s3://bucket[/prefix]``        S3 or any S3-compatible store (``s3`` driver)
``gs://bucket[/prefix]``        Google Cloud Storage (``gcs`` driver)
==============================  ================================================

Everything else is refused with :class:`~ckptfmt.errors.InvalidURLError` naming the URL and
the form expected, rather than guessed at. In particular: a scheme without ``//``
(``file:/abs``, ``file:rel``, ``memory:/x``, ``s3:bucket``), which would otherwise become a
directory named ``file:`` in the current directory; ``file://host/...`` for any host but
``localhost`` (``file://rel/dir`` names the host ``rel``, not a relative path); ``file:`` URLs
with ``%``, ``?`` or ``#`` (not percent-decoded: give such a path as a plain path); an unknown
scheme; a ``~user`` whose home directory is unknown; an empty URL. A local path whose first
segment contains ``:`` reads as a scheme: write it as ``./name:x``. Schemes are
case-insensitive.

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
import re
from typing import Any, Mapping

from ckptfmt.errors import InvalidManifestError, InvalidURLError

__all__ = ["kvstore_spec"]

# Short option names accepted for s3:// repositories, mapped onto the s3 driver's spec members.
# Any other option is passed to tensorstore unchanged (so every driver member and context
# resource, e.g. "requester_pays" or "s3_request_concurrency", works without a change here).
_S3_ALIASES = {"region": "aws_region", "endpoint_url": "endpoint"}


#: Default retry policy for s3:// repositories (override with the ``s3_request_retries`` option).
S3_DEFAULT_RETRIES = {"max_retries": 6, "initial_delay": "0.1s", "max_delay": "2s"}


# RFC 3986 scheme syntax. A one-letter "scheme" is still a scheme: "c:/x" is refused, not a path.
_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_SCHEMES = ("file", "memory", "s3", "gs")
_FORMS = {"file": "file:///absolute/path (or file://localhost/absolute/path)", "memory": "memory://name",
          "s3": "s3://bucket/prefix", "gs": "gs://bucket/prefix"}
_ANY_FORM = "a local path, file:///abs/path, memory://name, s3://bucket/prefix or gs://bucket/prefix"


def kvstore_spec(url: str, options: Mapping[str, Any] | None = None, *,
                 environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Return the tensorstore kvstore spec (a JSON dict) for a repository URL.

    ``options`` override what the URL and the environment give; for ``s3://`` they may use
    ``endpoint`` (or ``endpoint_url``), ``region`` (or ``aws_region``), ``host_header``,
    ``requester_pays``, ``profile`` (an AWS profile name -> profile credentials) and
    ``credentials`` (a credentials type such as ``"anonymous"``, or a full
    ``aws_credentials`` object). ``environ`` defaults to ``os.environ`` (tests pass their own).

    The path always ends with "/" (or is empty) so that keys are appended beneath it.
    Pure apart from reading the home directory for ``~``: opens nothing. Raises InvalidURLError
    (a CheckpointError naming the URL, the form expected and what was found) for a URL that is
    ambiguous, malformed or of an unknown scheme (see the module docstring), and
    InvalidManifestError for options that are not a mapping.
    """
    env = os.environ if environ is None else environ
    opts = _check_options(url, options)
    m = _SCHEME_RE.match(url)
    if m is None:
        return _merge({"driver": "file", "path": _local_path(url)}, opts)
    scheme, rest = m.group(1).lower(), url[m.end():]
    if scheme not in _SCHEMES:
        hint = "" if rest.startswith("//") else f" (a relative path whose first segment has ':' is written ./{url})"
        raise InvalidURLError(f"unsupported repository URL scheme {scheme!r}{hint}", object=url,
                              expected=_ANY_FORM, found=f"{scheme}:")
    if not rest.startswith("//"):
        raise InvalidURLError(f"a {scheme}: URL needs '//' after the scheme", object=url,
                              expected=_FORMS[scheme], found=f"{scheme}:{rest[:2]}")
    authority, slash, path = rest[2:].partition("/")
    if scheme == "file":
        return _merge({"driver": "file", "path": _file_path(url, authority, slash + path)}, opts)
    if scheme == "memory":
        return _merge({"driver": "memory", "path": _prefix(rest[2:])}, opts)
    if not authority:
        raise InvalidURLError("repository URL names no bucket", object=url,
                              expected=_FORMS[scheme], found=url)
    if scheme == "gs":
        return _merge({"driver": "gcs", "bucket": authority, "path": _prefix(path)}, opts)
    return _s3_spec(authority, _prefix(path), opts, env)


def _local_path(url: str) -> str:
    """A plain path: ``~`` expanded, made absolute against the current directory."""
    if not url:
        raise InvalidURLError("repository URL is empty", object=url, expected=_ANY_FORM, found="''")
    if "://" in url:  # "data/run://x": a path, or a URL mistyped? Refuse to guess.
        raise InvalidURLError("a local path must not contain '://'", object=url, expected=_ANY_FORM,
                              found=url)
    path = os.path.expanduser(url) if url.startswith("~") else url
    if path.startswith("~"):
        user = url[1:].split("/", 1)[0]
        raise InvalidURLError(f"no home directory is known for user {user!r}", object=url,
                              expected="~/path or ~user/path for an existing user", found=f"~{user}")
    return os.path.abspath(path).rstrip("/") + "/"


def _file_path(url: str, authority: str, path: str) -> str:
    if authority not in ("", "localhost"):
        raise InvalidURLError(f"file: URL names the host {authority!r}; only local files are supported "
                              "(a relative path is written without 'file://')", object=url,
                              expected=_FORMS["file"], found=f"host {authority!r}")
    if any(c in path for c in "%?#"):
        raise InvalidURLError("file: URLs are not percent-decoded and take no query or fragment; "
                              "give this path as a plain path", object=url, expected=_FORMS["file"],
                              found=next(c for c in path if c in "%?#"))
    if not path:
        raise InvalidURLError("file: URL names no path", object=url, expected=_FORMS["file"], found=url)
    return os.path.normpath("/" + path.lstrip("/")).rstrip("/") + "/"


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
