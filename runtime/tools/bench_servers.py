"""The two servers ``lmc bench --serve`` measures, each in a process of its
own on a free loopback port: ``lmc serve`` (a subprocess of this Python,
``-m runtime.cli serve``) and llama.cpp's server (the ``xllamacpp`` package,
which holds one server per process, so in a child Python too).

Both are context managers that yield the server's base URL once it answers,
and stop the process on the way out, whatever happened (an error, Ctrl-C):
a benchmark that leaves a server running would skew the next one. The
children get a session of their own, so a Ctrl-C reaches only the bench,
which then stops them in order; on Linux they also get SIGTERM should the
bench itself die without cleaning up. Their stderr (compile progress,
llama.cpp's request log) goes to a temporary file, not a pipe that could
fill and block them; its last lines explain a server that did not start.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

#: the checkout, so that ``-m runtime.cli`` finds the package whatever the caller's directory
ROOT = Path(__file__).resolve().parents[2]

#: the first run compiles the model for this CPU: allow for it
START_TIMEOUT_S = 900.0


class BenchServerError(RuntimeError):
    """A server did not start, or did not answer as it should."""


def _die_with_parent() -> Callable[[], object] | None:
    """What the child runs before exec, on Linux: ask for SIGTERM when the
    bench process dies (``PR_SET_PDEATHSIG``). Looked up here, before the
    fork, so that the child only makes the one system call (``preexec_fn``
    must not import or take locks)."""
    if sys.platform != "linux":
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)   # 1: PR_SET_PDEATHSIG


def _popen(cmd: list[str], log: IO[str], stdin: int | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, stdin=stdin, stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
                            preexec_fn=_die_with_parent())  # noqa: PLW1509 (see _die_with_parent)


def _first_line(proc: subprocess.Popen, log: IO[str], what: str, timeout: float) -> str:
    """The child's first stdout line (its address), or ``BenchServerError``
    with the end of its log when it exits or stays silent too long."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if "http://" in line:
                return line.strip()
            if not line:                   # end of its output: it is exiting
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
                break
            continue                       # something else first; the address is still to come
        if proc.poll() is not None:
            break
    log.flush()
    log.seek(0)
    tail = [ln.strip() for ln in log.read().splitlines() if ln.strip()][-1:] or ["no output"]
    why = "exited" if proc.poll() is not None else f"did not start within {timeout:.0f} s"
    raise BenchServerError(f"{what} {why}: {tail[0][:300]}")


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    """Wait up to ``grace_s`` for a process already asked to stop, then kill it."""
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def lmc_server(model: str, tokenizer: str | None, threads: int, parallel: int, ctx: int,
               extra: list[str] | None = None, timeout: float = START_TIMEOUT_S) -> Iterator[str]:
    """``lmc serve MODEL --port 0 -t THREADS --parallel P -c CTX [EXTRA]``;
    yields its URL (from the banner, its first stdout line); SIGTERM after."""
    cmd = [sys.executable, "-m", "runtime.cli", "serve", os.path.abspath(model), "--port", "0", "-t",
           str(threads), "--parallel", str(parallel), "-c", str(ctx), "--drain-timeout", "5", *(extra or [])]
    if tokenizer is not None:
        cmd += ["-z", os.path.abspath(tokenizer)]
    with tempfile.TemporaryFile("w+") as log:
        proc = _popen(cmd, log)
        try:
            banner = _first_line(proc, log, "lmc serve", timeout)
            yield "http://" + banner.split("http://", 1)[1].split()[0]
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)   # drains: nothing is running by now, or it is cut in 5 s
            _stop(proc, 30)
            proc.stdout.close()


#: the llama.cpp child: starts the server, prints its address, serves until its stdin closes
_LLAMA_CHILD = r"""
import os, sys
import xllamacpp as x
path, threads, parallel, n_ctx = sys.argv[1], *map(int, sys.argv[2:5])
p = x.CommonParams()
p.model.path = path
p.n_parallel = parallel
p.n_ctx = n_ctx              # split evenly between the slots (kv_unified off)
p.kv_unified = False
p.cont_batching = True
p.fit_params = False         # keep n_ctx as given
p.use_jinja = True           # the model's own chat template, as lmc serve uses
p.port = 0
p.cpuparams.n_threads = threads
p.cpuparams_batch.n_threads = threads
s = x.Server(p)
print(s.listening_address.rstrip("/"), flush=True)
sys.stdin.read()
os._exit(0)
"""


def llamacpp_version() -> str | None:
    """The installed ``xllamacpp``'s version, None when it is not installed."""
    try:
        import xllamacpp
    except ImportError:
        return None
    return str(getattr(xllamacpp, "__version__", None) or "unknown")


@contextlib.contextmanager
def llamacpp_server(model: str, threads: int, parallel: int, n_ctx: int,
                    timeout: float = START_TIMEOUT_S) -> Iterator[str]:
    """llama.cpp's server on ``model`` (a GGUF) with ``parallel`` slots,
    continuous batching and ``n_ctx`` positions in all; yields its URL; the
    child exits when its stdin closes (or is killed if it does not)."""
    cmd = [sys.executable, "-c", _LLAMA_CHILD, os.path.abspath(model), str(threads), str(parallel), str(n_ctx)]
    with tempfile.TemporaryFile("w+") as log:
        proc = _popen(cmd, log, stdin=subprocess.PIPE)
        try:
            yield _first_line(proc, log, "llama.cpp's server", timeout)
        finally:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            _stop(proc, 20)
            proc.stdout.close()
