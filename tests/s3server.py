"""A real local S3 server for tests: ``moto_server`` on 127.0.0.1 in a subprocess.

Use the pytest fixtures ``s3_server`` (one server per test session) and ``s3_env``
(per test: a fresh bucket, and the AWS_* variables a boto3 client or ckptfmt's
``s3://`` URLs read). Outside pytest, ``MotoServer`` is a context manager.

Tests that need the server skip (not fail) when ``moto[server]`` or boto3 is not
installed; ``make test`` installs both through the ``dev`` extra.
"""
from __future__ import annotations

import http.client
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlsplit

import pytest

from ckptfmt.coord import free_port

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"

# Variables that would point a client somewhere other than the test server.
_AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
             "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE",
             "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")


def _moto_server_binary() -> str | None:
    here = Path(sys.executable).parent / "moto_server"
    if here.exists():
        return str(here)
    return shutil.which("moto_server")


class MotoServer:
    """``moto_server -H 127.0.0.1 -p PORT``; ready once it answers HTTP. Stopped on exit."""

    def __init__(self, port: int | None = None, startup_timeout_s: float = 30.0) -> None:
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "MotoServer":
        binary = _moto_server_binary()
        if binary is None:
            raise RuntimeError("moto_server not found; install moto[server]")
        self._log = open(os.devnull, "wb")
        self._proc = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(self.port)],
                                      stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self._proc.returncode} on port {self.port}")
            try:
                # moto answers "/moto-api/" once its routes are up (no credentials needed).
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1).close()
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not answer on {self.endpoint}")
                time.sleep(0.1)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if getattr(self, "_log", None) is not None:
            self._log.close()

    def env(self) -> dict[str, str]:
        """The AWS_* variables that point boto3 and ckptfmt at this server."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": REGION}

    def client(self):  # -> botocore S3 client
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"ckpt-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def __enter__(self) -> "MotoServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class S3Env:
    """What a test gets: the server, a fresh empty bucket, and a boto3 client for editing objects."""

    server: MotoServer
    bucket: str
    client: object

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def url(self, prefix: str = "repo") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def keys(self, prefix: str = "") -> list[str]:
        out: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            out.extend(o["Key"] for o in page.get("Contents", []))
        return sorted(out)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoServer]:
    pytest.importorskip("boto3")
    pytest.importorskip("moto")
    if _moto_server_binary() is None:
        pytest.skip("moto_server not installed (pip install 'moto[server]')")
    with MotoServer() as server:
        yield server


@pytest.fixture
def s3_env(s3_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> S3Env:
    for var in _AWS_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in s3_server.env().items():
        monkeypatch.setenv(var, value)
    bucket = s3_server.create_bucket()
    return S3Env(s3_server, bucket, s3_server.client())


class FaultProxy:
    """An HTTP proxy in front of the S3 server that can make the store misbehave on purpose.

    ``hide="manifests/"``: HEAD and GET of object paths containing that text answer 404 (``""``
    hides every object), so a client's existence check sees "absent": the race in which another
    writer's PUT lands between our check and our PUT. Listings are not affected.
    ``unlisted="manifests/"``: object listings omit keys containing that text, as a store whose
    LIST lags behind its PUTs (no list-after-write consistency).
    ``drop_conditions=True``: If-None-Match / If-Match are removed from PUTs, as on a store
    that ignores conditional headers. moto does not verify SigV4 signatures, so edited
    requests are still accepted. ``reject_conditions=True``: a PUT carrying If-None-Match is
    answered 501 NotImplemented, as by a store that knows no conditional writes.
    ``before=fn``: ``fn(method, path)`` runs right before each request is forwarded, so a test
    can make another client's write land at that exact moment (between a client's HEAD and its
    PUT or DELETE, say).
    """

    def __init__(self, upstream: str, *, hide: str | None = None, unlisted: str | None = None,
                 drop_conditions: bool = False, reject_conditions: bool = False,
                 before: Callable[[str, str], None] | None = None) -> None:
        up = urlsplit(upstream)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("connection", "keep-alive", "proxy-connection")}
                path = self.path.split("?", 1)[0]
                is_object = len(path.split("/", 2)) == 3 and path.split("/", 2)[2] != ""  # /bucket/key
                if self.command in ("HEAD", "GET") and proxy.hide is not None and is_object and proxy.hide in path:
                    msg = b"" if self.command == "HEAD" else b"<Error><Code>NoSuchKey</Code></Error>"
                    self.send_response(404)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                if self.command == "PUT" and proxy.reject_conditions and "If-None-Match" in self.headers:
                    msg = b"<Error><Code>NotImplemented</Code><Message>conditional PUT</Message></Error>"
                    self.send_response(501)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                if proxy.before is not None:
                    proxy.before(self.command, path)
                if self.command == "PUT" and proxy.drop_conditions:
                    headers = {k: v for k, v in headers.items() if k.lower() not in ("if-none-match", "if-match")}
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                if self.command == "GET" and "list-type=2" in self.path and proxy.unlisted is not None:
                    data = _drop_listed(data, proxy.unlisted)
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "content-length", "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.hide = hide
        self.before = before
        self.unlisted = unlisted
        self.drop_conditions = drop_conditions
        self.reject_conditions = reject_conditions
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "FaultProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def _drop_listed(xml: bytes, text: str) -> bytes:
    """Remove the <Contents> entries whose <Key> contains ``text`` from a ListObjectsV2 reply."""

    def keep(m: re.Match[bytes]) -> bytes:
        key = re.search(rb"<Key>(.*?)</Key>", m.group(0))
        return b"" if key and text.encode() in key.group(1) else m.group(0)

    return re.sub(rb"<Contents>.*?</Contents>", keep, xml, flags=re.S)
