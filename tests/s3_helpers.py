"""A real S3 endpoint for the tests: moto's server mode on 127.0.0.1, one process.

    server = MotoServer.start(tmp_dir)       # a free port, waits until it answers
    run_cli("pack", src, "s3://bkt/ds.fs", env=server.env)
    server.fs()                               # an s3fs client for setting up data
    server.stop()                             # SIGCONT (if a test stopped it), then end it

``server.env`` holds the standard AWS variables (endpoint, credentials, region) for the
processes a test starts; nothing else is needed to reach the endpoint.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

MOTO = os.path.join(os.path.dirname(sys.executable), "moto_server")


def moto_available() -> tuple[bool, str]:
    if not (os.access(MOTO, os.X_OK) or shutil.which("moto_server")):
        return False, "moto_server is not installed (pip install 'moto[server]')"
    try:
        import s3fs  # noqa: F401
    except ImportError:
        return False, "s3fs is not installed (pip install 'fanstore[s3]')"
    return True, ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    def __init__(self, proc: subprocess.Popen, port: int, log: str) -> None:
        self.proc = proc
        self.port = port
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        self.env = {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "fanstore-test",
            "AWS_SECRET_ACCESS_KEY": "fanstore-test-secret",
            "AWS_REGION": "us-east-1",
        }

    @classmethod
    def start(cls, tmp, extra_env: dict | None = None, timeout: float = 30) -> "MotoServer":
        exe = MOTO if os.access(MOTO, os.X_OK) else shutil.which("moto_server")
        port = free_port()
        log = os.path.join(os.fspath(tmp), f"moto-{port}.log")
        env = dict(os.environ, **(extra_env or {}))
        with open(log, "wb") as out:
            proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=out,
                                    stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        server = cls(proc, port, log)
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto_server exited {proc.returncode}: {server.tail()}")
            try:
                urllib.request.urlopen(server.url + "/moto-api/", timeout=1).read()
                return server
            except OSError:
                if time.monotonic() > deadline:
                    server.stop()
                    raise RuntimeError(f"moto_server did not answer in {timeout} s")
                time.sleep(0.1)

    def tail(self, n: int = 2000) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def fs(self, **kw):
        """An s3fs client on this endpoint (the tests' own, for setting up data)."""
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=self.url, key=self.env["AWS_ACCESS_KEY_ID"],
                                 secret=self.env["AWS_SECRET_ACCESS_KEY"],
                                 skip_instance_cache=True, **kw)

    def new_bucket(self, prefix: str = "b") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.fs().mkdir(name)
        return name

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        try:
            os.kill(self.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.resume()
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)

    def set_auth(self, after_requests: int) -> None:
        """Enforce IAM authentication after ``after_requests`` more requests (moto's
        reset-auth API)."""
        req = urllib.request.Request(self.url + "/moto-api/reset-auth", method="POST",
                                     data=str(after_requests).encode(),
                                     headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(req, timeout=5).read()
