"""Files the user names (``-o``, converted and synthetic models, artifacts)
and flags, through the ``lmc`` command: bad ones are one line on stderr
naming the path or flag, exit status 2, and nothing left behind.

A full disk is a file-size limit here (RLIMIT_FSIZE in the child, SIGXFSZ
ignored): every write past it fails with EFBIG, as one past a full disk
fails with ENOSPC, without needing a small file system."""
from __future__ import annotations

import os
import resource
import signal
import stat
import subprocess
import sys

import pytest

from runtime.models import BUNDLED_MODEL as S, BUNDLED_TOKENIZER as K

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lmc(*args: str, fsize: int | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    def limit() -> None:
        if fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=limit)


def refused(r: subprocess.CompletedProcess, *names: str) -> str:
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in names:
        assert n in err, (n, err)
    return err


WRITERS = {
    "compile": ["compile", S, "-z", K, "-t", "1", "-o"],
    "ir": ["ir", S, "-z", K, "-o"],
    "plan": ["plan", S, "-z", K, "-t", "1", "--format", "svg", "-o"],
    "convert": ["convert", S, "-z", K, "--qtype", "q8", "--"],   # its output is the second positional
    "synth gguf": ["synth", "--shape", "stories15M", "--format", "gguf", "-o"],
}


@pytest.mark.parametrize("what", WRITERS)
def test_never_over_a_device_or_a_pipe(tmp_path, what):
    """A rename over /dev/full replaced the device with an artifact."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    refused(lmc(*WRITERS[what], str(fifo)), str(fifo), "not a regular file")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert os.listdir(tmp_path) == ["pipe"]


@pytest.mark.parametrize("what", WRITERS)
def test_a_full_disk_leaves_nothing_and_names_the_file(tmp_path, tmp_path_factory, what):
    if what == "compile":   # the artifact cached first (the limit would stop the cache's copy before ours)
        warm = tmp_path_factory.mktemp("warm") / "a.lmc"
        assert lmc(*WRITERS[what], str(warm)).returncode == 0
    out = tmp_path / "out.file"
    err = refused(lmc(*WRITERS[what], str(out), fsize=4096), str(out))
    assert "File too large" in err
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)     # no output, no .part


@pytest.mark.parametrize("what", WRITERS)
def test_a_missing_folder_is_named(tmp_path, what):
    out = tmp_path / "no" / "such" / "out.file"
    refused(lmc(*WRITERS[what], str(out)), str(out))
    assert os.listdir(tmp_path) == []


def test_synth_writes_the_model_and_its_tokenizer_or_neither(tmp_path):
    out, tok = tmp_path / "m.bin", tmp_path / "no" / "tok.bin"
    refused(lmc("synth", "--shape", "stories15M", "-o", str(out), "--tokenizer", str(tok)), str(tok))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("args,names", [
    (["loadtest", "http://[::1"], ["url", "http://[::1"]),
    (["loadtest", "http://127.0.0.1:abc"], ["url", "abc"]),
    (["loadtest", "http://127.0.0.1:99999"], ["url", "65535"]),
    (["loadtest", "ftp://127.0.0.1"], ["url", "http"]),
    (["serve", S, "-z", K, "--port", "99999"], ["--port", "65535"]),
    (["viz", S, "-z", K, "--port", "70000", "--no-open"], ["--port", "65535"]),
    (["run", S, "-z", K, "-p", "hi", "-n", "2", "--temp", "inf"], ["--temp"]),
    (["run", S, "-z", K, "-p", "hi", "-n", "2", "--temp", "1e308"], ["--temp"]),
    (["run", S, "-z", K, "-p", "hi", "-n", "2", "--repeat-penalty", "1e-300"], ["--repeat-penalty"]),
    (["run", S, "-z", K, "-p", "hi", "-n", "3", "-t", "1", "--regex", "a{99999999}"], ["regex", "cannot be enforced", "lexer"]),
    (["inspect", S, "-z", "/no/such/tok.bin"], ["/no/such/tok.bin", "-z"]),
    (["serve", S, "-z", K, "--drain-timeout", "-1"], ["--drain-timeout"]),
    (["convert", S, "-z", K, "/tmp/never-written.qsf", "--compress", "zstd", "--level", "99"], ["--level", "zstd"]),
    (["convert", S, "-z", K, "/tmp/never-written.qsf", "--compress", "lz4", "--level", "-1"], ["--level", "lz4"]),
    # an empty key (--api-key "$KEY" with KEY unset) would leave the server open
    (["serve", S, "-z", K, "--api-key", ""], ["--api-key", "empty"]),
    (["serve", S, "-z", K, "--api-key", "two words"], ["--api-key", "spaces"]),
    # a host that does not resolve: the error alone, not a warning about listening on it first
    (["serve", S, "-z", K, "--host", "999.1.1.1"], ["--host", "999.1.1.1"]),
    (["viz", S, "-z", K, "--host", "999.1.1.1", "--no-open"], ["--host", "999.1.1.1"]),
    # a budget below the runtime's floor: the error alone, not viz's progress line before it
    (["viz", S, "-z", K, "--mem-budget", "1K", "--no-open"], ["--mem-budget"]),
    # the pool the user asked for, not its rounding up to whole blocks (16 here)
    (["serve", S, "-z", K, "-c", "64", "--kv-pool", "5"], ["--kv-pool 5:", "(64)"]),
])
def test_bad_flags_are_one_line(args, names):
    refused(lmc(*args, timeout=120), *names)   # a server that starts instead fails here, not hangs


def test_a_prompt_file_that_is_not_utf8_is_named(tmp_path):
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"\xff\xfe not text")
    refused(lmc("bench", S, "-z", K, "-t", "1", "--runs", "1", "--prompt-file", str(bad), timeout=120),
            "--prompt-file", str(bad), "UTF-8")
