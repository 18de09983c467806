"""`mt serve` in a process of its own, for the cross-app tests (a helper module of tests/, not
a test): started on a free port, waited for, its log kept for failures, stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from mt_dist import free_port

NAME = "tiny"
"""The model name the test servers answer to."""


class Server:
    """`mt serve CKPT --model-name tiny ARGS` (``env``: variables added to the server's)."""

    def __init__(self, ckpt: Path, log: Path, *args: str, env: dict[str, str] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = headers or {}
        environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}),
                   "PYTHONPATH": os.pathsep.join(os.path.abspath(p) for p in sys.path if p)}
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mt_inference", "serve", str(ckpt), "--port",
             str(self.port), "--model-name", NAME, *args],
            env=environ, stdout=subprocess.DEVNULL, stderr=log.open("w"))
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"the server did not start: {log.read_text()}")

    def post(self, body: object, **kw: object) -> httpx.Response:
        """POST ``body`` (JSON-encoded unless bytes or text) to /v1/completions."""
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        headers = {**self.headers, **kw.pop("headers", {})}  # type: ignore[dict-item]
        return httpx.post(f"{self.url}/v1/completions", content=content, timeout=120,
                          headers=headers, **kw)

    def alive(self) -> bool:
        """The process runs and /health answers 200."""
        return self.proc.poll() is None and httpx.get(f"{self.url}/health",
                                                      timeout=10).status_code == 200

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)
