"""A real ``lmc serve`` process on a free loopback port, for the tests."""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx

ROOT = Path(__file__).resolve().parents[1]


def stream_into(url: str, body: dict, lines: list[str], started: threading.Event) -> None:
    """POST a streaming completion and keep its non-empty SSE lines; ``started`` is set at the first."""
    with httpx.stream("POST", f"{url}/v1/completions", timeout=300, json={**body, "stream": True}) as r:
        for ln in r.iter_lines():
            if ln:
                lines.append(ln)
                started.set()


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, banner: str) -> None:
        self.proc, self.url, self.banner = proc, url, banner

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> tuple[int, str, str]:
        """Signal it and wait: (exit code, the rest of stdout, stderr)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err


@contextlib.contextmanager
def serve(model: str, *args: str, timeout: float = 600) -> Iterator[Server]:
    """Start ``lmc serve MODEL --port 0 ARGS``; yields once it listens (its
    first stdout line names the URL); stops it with SIGTERM afterwards and
    checks that it exited cleanly."""
    cmd = [sys.executable, "-m", "runtime.cli", "serve", model, "--port", "0", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout
    line = ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            break
        if proc.poll() is not None:
            break
    if "http://" not in line:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"lmc serve did not start: {line}{out}\n{err}")
    url = line.split("http://", 1)[1].split()[0]
    server = Server(proc, f"http://{url}", line)
    try:
        yield server
    finally:
        if proc.poll() is None:
            code, out, err = server.stop()
            assert code == 0, err
            assert "lmc serve: stopped" in out, (out, err)


def wait_until(cond: Callable[[], Any], what: str, timeout: float = 60.0, every: float = 0.05) -> Any:
    """Poll ``cond`` until it is truthy; its value, or an AssertionError naming ``what``."""
    end = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)
