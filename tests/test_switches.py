"""The LMC_* switches: 0 or 1, else a one-line error naming the variable,
from the library and from the ``lmc`` command."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ir.switches import SWITCHES, switch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(SWITCHES))
def test_values(name, monkeypatch):
    default = SWITCHES[name][0]
    monkeypatch.delenv(name, raising=False)
    assert switch(name) is default
    monkeypatch.setenv(name, "")
    assert switch(name) is default
    monkeypatch.setenv(name, "0")
    assert switch(name) is False
    monkeypatch.setenv(name, "1")
    assert switch(name) is True
    for bad in ("off", "yes", "2", "true"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=rf"^{name}='{bad}': set it to 0 or 1"):
            switch(name)


def test_the_command_refuses_a_bad_switch(tmp_path):
    """`LMC_AMX=off lmc run ...`: exit 2, one line, nothing compiled into the cache."""
    env = {**os.environ, "LMC_AMX": "off", "LMC_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "run", "-n", "2", "-p", "hi"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == ["lmc: error: LMC_AMX='off': set it to 0 or 1 (or unset it: 1, "
                                             "AMX tiles where the CPU has them (0: the VNNI code))"]
    assert r.stdout == ""
    made = {p.name for p in (tmp_path / "cache").iterdir()} if (tmp_path / "cache").exists() else set()
    assert not made & {"kernels", "native", "repacked", "memo"}, made   # nothing compiled
    assert not list((tmp_path / "cache").glob("*.lmca"))
