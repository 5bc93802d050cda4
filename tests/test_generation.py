"""Generation as a user drives it: stop strings, stop reasons, the end of the
context (run.c's clipping), and a KV cache that keeps a shared prefix."""
from __future__ import annotations

import dataclasses

import pytest

import runtime
from runtime.stop_strings import StopMatcher, StopStringError, check_stops
from shared_data import MODELS, needs_shared, reference_cases

RUNC = reference_cases("stories260K_runc.json")


# --- stop strings, one boundary case each ---------------------------------------------------

def feed_all(stops, pieces):
    """What a stream shows, piece by piece, and whether it stopped."""
    m = StopMatcher(stops)
    shown = []
    for p in pieces:
        out, stopped = m.feed(p)
        shown.append(out)
        if stopped:
            return shown, True, m.stopped
    shown.append(m.flush())
    return shown, False, None


def test_stop_string_split_across_tokens():
    shown, stopped, which = feed_all(["END"], ["The e", "nd. E", "N", "D and more"])
    assert stopped and which == "END"
    assert "".join(shown) == "The end. "
    # "E" and "N" were held back: no piece ever showed a part of the stop string
    assert shown == ["The e", "nd. ", "", ""]


def test_stop_string_at_the_very_start():
    shown, stopped, _ = feed_all(["Q:"], ["Q", ": what"])
    assert stopped and "".join(shown) == ""
    shown, stopped, _ = feed_all(["Q:"], ["Q:x"])
    assert stopped and shown == [""]


def test_two_overlapping_stop_strings():
    # "ab" completes first although "abc" began at the same place: the earliest end wins at the earliest start
    shown, stopped, which = feed_all(["bcd", "ab"], ["xa", "bcd"])
    assert stopped and which == "ab" and "".join(shown) == "x"
    # "bcd" starts inside the held-back prefix of "abc..." and completes: cut before it
    shown, stopped, which = feed_all(["abcX", "bcd"], ["za", "b", "c", "d"])
    assert stopped and which == "bcd" and "".join(shown) == "za"
    assert shown == ["z", "", "", "a"]


def test_held_back_text_is_released_when_it_cannot_be_a_stop():
    shown, stopped, _ = feed_all(["\n\nUser:"], ["Hi", "\n", "\n", "Us", "ually"])
    assert not stopped and "".join(shown) == "Hi\n\nUsually"
    assert shown[:4] == ["Hi", "", "", ""]


def test_bad_stop_strings():
    for bad in ([""], [None], ["x"] * 17, ["y" * 2000]):
        with pytest.raises(StopStringError):
            check_stops(bad)
    assert check_stops("one") == ["one"]


# --- the Python API on a real model ---------------------------------------------------------

@pytest.fixture(scope="module")
def stories():
    if not MODELS.is_dir():
        pytest.skip("../shared (models and references) is absent")
    return runtime.load(MODELS / "stories260K.bin", MODELS / "tok512.bin", threads=2)


def test_complete_stops_at_a_stop_string_and_never_streams_it(stories):
    full = stories.complete("Once upon a time", 60, temperature=0.0)
    assert stories.last_completion.stop_reason == "length"
    stop = full[20:26]
    pieces = list(stories.complete("Once upon a time", 60, temperature=0.0, stream=True, stop=[stop]))
    comp = stories.last_completion
    assert "".join(pieces) == full[: full.index(stop)] == comp.text
    assert comp.stop_reason == "stop" and comp.stop_string == stop
    assert not any(stop in p for p in pieces)


def test_complete_reuses_the_cached_prefix(stories):
    """A second request sharing the prompt's beginning prefills only the
    rest; its output is that of a fresh run (greedy, f32 model)."""
    a = stories.complete("Once upon a time, there was a little girl", 30, temperature=0.0, reuse_cache=False)
    b = stories.complete("Once upon a time, there was a little girl", 30, temperature=0.0)
    assert a == b
    c_ids = stories.encode("Once upon a time, there was a little girl named Lily")
    fresh = runtime.load(MODELS / "stories260K.bin", MODELS / "tok512.bin", threads=2)
    want = list(fresh.generate(c_ids, 20, temperature=0.0))
    got = list(stories.generate(c_ids, 20, temperature=0.0, reuse_cache=True))
    cached = stories.last_completion.cached_tokens
    assert got == want
    assert cached >= len(stories.encode("Once upon a time, there was a little girl")) - 1


@needs_shared
def test_n_beyond_the_context_stops_at_its_end_as_run_c(tmp_path):
    """run.c clips its steps to the model's seq_len. stories260K rewritten
    with a header seq_len of 256 therefore prints, for any larger -n,
    exactly what run.c printed with steps 256 on the original; lmc must too,
    and say why it stopped."""
    from compiler.driver import load_model
    from frontends.llama2c_writer import write_llama2c
    from ir.interp import WeightStore
    from ir.ops import WeightData

    src = load_model(MODELS / "stories260K.bin", MODELS / "tok512.bin")
    store = WeightStore()
    cfg = dataclasses.replace(src.config, seq_len=256)
    path = tmp_path / "stories260K-256.bin"
    write_llama2c(path, cfg, lambda n: WeightData(store.raw(src.weights[n].ref), src.weights[n].type).to_f32())
    m = runtime.load(path, MODELS / "tok512.bin", threads=2, kv_type="f32")   # run.c's cache
    assert m.ctx == 256
    cases = [c for c in RUNC if c["steps"] == 256]
    assert len(cases) >= 4
    for case in cases:
        got = list(m.generate(case["prompt_ids"], 1000, temperature=case["temperature"], top_p=case["top_p"],
                              seed=case["seed"]))
        assert got == case["generated_ids"]
        ended_by_bos = got[-1] == 1
        assert m.last_completion.stop_reason == ("eos" if ended_by_bos else "length")
        assert ended_by_bos or len(case["prompt_ids"]) + len(got) - 1 == 256
