"""``lmc viz``: the compiler in the browser, tested through a real ``lmc viz``
process and its JSON API, then as a person meets it: Debian's Chromium
(headless) driven by Selenium picks a pass, clicks a node in the picture
and reads its kernel's assembly.

Two viewers run for the module: a 3-layer Q4_K GGUF (every matmul has a
dequant for ``fuse_dequant`` to fuse; stopped with SIGINT, as Ctrl-C) and
the bundled stories260K with ``--profile --stream layers`` (time per node,
a streaming schedule; stopped with SIGTERM). The browser test skips where
Chromium, its driver or Selenium are not installed.
"""
from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from serve_process import wait_until

from compiler.driver import CompileOptions, load_model
from compiler.pipeline import default_pipeline
from runtime.cli import main
from runtime.tools.viz.diff import step_diff
from runtime.tools.viz.kernel_code import find_mca
from runtime.tools.viz.session import Session
from runtime.tools.viz.steps import record_steps
from test_gguf_frontend import tiny

try:
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
except ImportError:   # the browser test skips (it says why); the others run
    webdriver = None

pytestmark = pytest.mark.xdist_group("viz")   # the module's viewers and browser on one worker

ROOT = Path(__file__).resolve().parents[1]
STORIES = "runtime/default_model/stories260K.bin"
STORIES_TOK = "runtime/default_model/tok512.bin"
N_LAYERS = 3
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
SCREENSHOT = "/tmp/viz.png"


class Viewer:
    def __init__(self, proc: subprocess.Popen, url: str) -> None:
        self.proc, self.url = proc, url

    def get(self, path: str, **params: Any) -> httpx.Response:
        return httpx.get(self.url + path.lstrip("/"), params=params, timeout=300)

    def json(self, path: str, **params: Any) -> Any:
        r = self.get(path, **params)
        assert r.status_code == 200, (path, r.status_code, r.text)
        return r.json()


@contextlib.contextmanager
def viz(*args: str, stop: int = signal.SIGTERM, timeout: float = 600) -> Iterator[Viewer]:
    """``lmc viz ARGS --no-open --port 0``; yields once its first stdout line
    names the URL; stops it with ``stop`` and checks it exits 0, saying so."""
    cmd = [sys.executable, "-m", "runtime.cli", "viz", *args, "--no-open", "--port", "0"]
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
    m = re.fullmatch(r"lmc viz: (http://127\.0\.0\.1:\d+/)\n", line)
    if m is None:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"lmc viz did not start: {line!r}{out}\n{err}")
    try:
        yield Viewer(proc, m.group(1))
    finally:
        if proc.poll() is None:
            proc.send_signal(stop)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (proc.returncode, err)
        assert out.strip().splitlines()[-1] == "lmc viz: stopped", (out, err)


@pytest.fixture(scope="module")
def q4k(tmp_path_factory) -> str:
    p, _ = tiny(tmp_path_factory.mktemp("viz"), "Q4_K", n_layers=N_LAYERS)
    return str(p)


@pytest.fixture(scope="module")
def qviz(q4k) -> Iterator[Viewer]:
    with viz(q4k, stop=signal.SIGINT) as v:
        yield v


@pytest.fixture(scope="module")
def sviz() -> Iterator[Viewer]:
    with viz(STORIES, "-z", STORIES_TOK, "--profile", "--stream", "layers", "-t", "1") as v:
        yield v


def steps_of(v: Viewer) -> list[dict]:
    return [v.json(f"/api/step/{p['index']}") for p in v.json("/api/passes")]


# --- the passes and what they changed ----------------------------------------------------------

def test_passes_are_the_pipelines(qviz):
    passes = qviz.json("/api/passes")
    assert [p["name"] for p in passes] == ["frontend", *default_pipeline("llvm")]
    assert [p["index"] for p in passes] == list(range(len(passes)))
    for p in passes:
        assert p["summary"].startswith(p["name"] + ":") and p["nodes"] > 0 and p["doc"]
    info = qviz.json("/api/info")
    assert info["n_layers"] == N_LAYERS and info["steps"] == len(passes) and info["profile"] is False
    assert info["llvm_mca"] == find_mca()


def test_fuse_dequant_fuses_every_dequant_into_its_matmul(qviz):
    before, after = qviz.json("/api/step/0"), qviz.json("/api/step/fuse_dequant")
    dequants = {n["name"] for n in before["nodes"] if n["op"] == "dequant"}
    matmuls = {n["name"] for n in before["nodes"] if n["op"] == "matmul"}
    assert len(dequants) == len(matmuls) == 7 * N_LAYERS + 1
    d = after["diff"]
    assert {r["name"] for r in d["removed"]} == dequants and {r["op"] for r in d["removed"]} == {"dequant"}
    assert {f["name"] for f in d["fused"]} == matmuls and not d["added"]
    ops = {n["name"]: n["op"] for n in after["nodes"]}
    for f in d["fused"]:
        assert (f["was"], f["op"], ops[f["name"]]) == ("matmul", "qmatmul", "qmatmul")
        assert len(f["absorbed"]) == 1 and f["absorbed"][0] in dequants
        assert "+layout=Q4_K" in f["changes"]
    assert "dequant" not in ops.values()
    assert d["summary"].startswith(f"fuse_dequant: {len(before['nodes'])} -> {len(after['nodes'])} nodes")
    assert f"removed {len(dequants)} (dequant x{len(dequants)})" in d["summary"]


def test_every_diff_names_real_nodes(qviz):
    """Removed nodes were in the step before and are gone; fused, changed,
    added and moved ones are in this step; the counts add up."""
    steps = steps_of(qviz)
    assert steps[0]["diff"]["nodes_before"] is None
    for prev, cur in zip(steps, steps[1:]):
        old, new = {n["name"] for n in prev["nodes"]}, {n["name"] for n in cur["nodes"]}
        d = cur["diff"]
        assert {r["name"] for r in d["removed"]} == old - new
        assert {a["name"] for a in d["added"]} == new - old
        for e in d["fused"] + d["changed"]:
            assert e["name"] in new & old and e["changes"]
        for f in d["fused"]:
            assert set(f["absorbed"]) <= old - new
        assert set(d["moved"]) <= new & old
        assert (d["nodes_before"], d["nodes_after"]) == (len(prev["nodes"]), len(cur["nodes"]))
    by = {s["name"]: s["diff"] for s in steps}
    assert any(f["op"] == "glu" and f["absorbed_ops"] == ["silu"] for f in by["fuse_elementwise"]["fused"])


def test_moved_nodes_are_the_fewest_that_explain_the_new_order(q4k):
    m = load_model(q4k, None)
    g = record_steps(m, "decode", CompileOptions(backend="llvm", ctx=32, passes=()))[0].graph
    import copy

    h = copy.deepcopy(g)
    h.nodes = [h.nodes[0], h.nodes[2], h.nodes[1], *h.nodes[3:]]   # two neighbours swap
    d = step_diff(g, h, "swap")
    assert len(d["moved"]) == 1 and d["moved"][0] in (g.nodes[1].output.name, g.nodes[2].output.name)
    assert d["summary"] == f"swap: {len(g.nodes)} -> {len(g.nodes)} nodes; moved 1"
    assert step_diff(g, copy.deepcopy(g), "same")["summary"].endswith("no change")


# --- a node and its kernel -----------------------------------------------------------------------

def test_node_shows_operands_layer_and_kernel_signature(qviz):
    after = qviz.json("/api/step/fuse_dequant")
    f = next(f for f in after["diff"]["fused"] if f["name"] in after["overview_peers"])   # one of block 0
    n = qviz.json(f"/api/node/fuse_dequant/{f['name']}")
    assert n["op"] == "qmatmul" and n["layer"] == 0 and n["attrs"]["layout"] == "Q4_K"
    x, w = n["inputs"]
    assert w["kind"] == "weight" and w["layout"] == "Q4_K" and w["name"].startswith("blk.0.")
    assert x["producer"]["name"] in {s["name"] for s in after["nodes"]}
    assert n["signature"]["name"].startswith("k_qmatmul_") and n["signature"]["in_types"][1].startswith("Q4_K:")
    assert n["in_diff"]["kind"] == "fused" and n["in_diff"]["absorbed"] == f["absorbed"]
    assert n == qviz.json(f"/api/node/1/%25{f['name']}")   # by step number, and with the sigil too
    peers = after["overview_peers"][f["name"]]
    assert len(peers) == N_LAYERS and peers[0] == f["name"]
    assert [qviz.json(f"/api/node/1/{p}")["layer"] for p in peers] == list(range(N_LAYERS))


def test_kernel_has_ir_assembly_and_mca(qviz):
    last = qviz.json("/api/passes")[-1]["index"]
    norm = next(n for n in qviz.json(f"/api/step/{last}")["nodes"] if n["op"] == "rmsnorm")
    k = qviz.json(f"/api/kernel/{last}/{norm['name']}")
    sym = qviz.json(f"/api/node/{last}/{norm['name']}")["signature"]["name"]
    assert k["available"] and k["name"] == sym
    assert re.search(rf'^define .*"?{sym}"?\(', k["ir"], re.M)
    assert re.search(rf"^define .*{sym}\(", k["ir_optimized"], re.M)
    assert re.search(rf"^{sym}:$", k["asm"], re.M)
    instructions = re.findall(r"^\s+([a-z][a-z0-9]*)\s", k["asm"], re.M)
    assert len(instructions) > 10 and {"ret", "retq"} & set(instructions)
    mca = k["mca"]
    if find_mca() is None:
        assert not mca["available"] and "not installed" in mca["reason"]
    else:
        assert mca["available"], mca
        assert "Iterations:" in mca["text"] and "Resource pressure" in mca["text"]


def test_node_without_a_native_kernel_says_so(qviz):
    dq = next(n for n in qviz.json("/api/step/0")["nodes"] if n["op"] == "dequant")
    k = qviz.json(f"/api/kernel/0/{dq['name']}")
    assert k["available"] is False and "no native kernel for op 'dequant'" in k["reason"]


# --- pictures and errors -------------------------------------------------------------------------

def svg_titles(r: httpx.Response) -> set[str]:
    """The DOT ids of the picture's nodes (the page finds them the same way)."""
    assert r.status_code == 200 and r.headers["content-type"].startswith("image/svg+xml")
    ns = "{http://www.w3.org/2000/svg}"
    return {g.find(ns + "title").text for g in ET.fromstring(r.content).iter(ns + "g") if g.get("class") == "node"}


def test_pictures_draw_the_steps_nodes(qviz):
    step = qviz.json("/api/step/fuse_dequant")
    names = {n["name"]: n for n in step["nodes"]}
    overview = svg_titles(qviz.get("/api/graph/1.svg", view="overview"))
    drawn = {t.removeprefix("node %") for t in overview if t.startswith("node %")}
    assert drawn == {k for k, n in names.items() if n["layer"] in (0, "embedding", "head")}
    layer2 = svg_titles(qviz.get("/api/graph/fuse_dequant.svg", view="layer", layer=2))
    assert {t.removeprefix("node %") for t in layer2 if t.startswith("node %")} == \
        {k for k, n in names.items() if n["layer"] == 2}
    first = svg_titles(qviz.get("/api/graph/0.svg"))
    assert any(t.startswith("node %") and t[6:] not in names for t in first)   # the dequants, before fusion


@pytest.mark.parametrize("path, params", [
    ("/api/step/99", {}), ("/api/step/no_such_pass", {}), ("/api/node/0/999999", {}), ("/api/node/99/1", {}),
    ("/api/kernel/1/no_such_node", {}), ("/api/kernel/99/1", {}), ("/api/graph/99.svg", {}),
    ("/api/graph/1.svg", {"view": "layer", "layer": N_LAYERS}), ("/api/graph/1.svg", {"view": "sideways"}),
    ("/api/profile", {}), ("/api/no/such/route", {}),
])
def test_bad_ids_are_json_404s(qviz, path, params):
    r = qviz.get(path, **params)
    assert r.status_code == 404 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]
    assert qviz.get("/api/info").status_code == 200   # still up


def test_malformed_query_is_json_400(qviz):
    r = qviz.get("/api/graph/1.svg", view="layer", layer="x")
    assert r.status_code == 400 and "layer" in r.json()["error"]


# --- memory plan, streaming schedule and profile ---------------------------------------------------

def test_plan_shows_the_streaming_schedule(sviz):
    n_layers = load_model(STORIES, STORIES_TOK).config.n_layers
    plan = sviz.json("/api/plan")
    assert plan["text"].startswith("memory plan for") and "streams the layers" in plan["text"]
    assert plan["arena_svg"].lstrip().startswith("<svg") and plan["report"]["stream_layers"] is True
    segs = plan["stream"]["segments"]
    last = sviz.json("/api/passes")[-1]["index"]
    nodes = {n["name"]: n for n in sviz.json(f"/api/step/{last}")["nodes"]}
    layers = [s for s in segs if s["name"].startswith("layer ")]
    assert [s["name"] for s in layers] == [f"layer {i}" for i in range(n_layers)]
    for i, s in enumerate(layers):
        assert s["weights"] and all(w.startswith(f"blk.{i}.") for w in s["weights"])
        assert s["nodes"] and {nodes[x]["layer"] for x in s["nodes"]} == {i}
        assert s["buffer"] == s["index"] % 2
    reader = layers[1]["nodes"][0]
    assert sviz.json(f"/api/node/{last}/{reader}")["stream_segments"] == ["layer 1"]


def test_profile_times_every_node_of_the_last_step(sviz):
    p = sviz.json("/api/profile")
    last = sviz.json("/api/passes")[-1]["index"]
    nodes = {n["name"]: n for n in sviz.json(f"/api/step/{last}")["nodes"]}
    assert p["step"] == last and p["entry"] == "decode" and p["note"] is None
    assert set(p["nodes"]) == set(nodes)
    for name, t in p["nodes"].items():
        assert t["op"] == nodes[name]["op"] and t["index"] == nodes[name]["index"] and t["us"] >= 0
    us = [n["us"] for n in p["top"]]
    assert us == sorted(us, reverse=True) and p["top"][0]["us"] == max(t["us"] for t in p["nodes"].values())
    assert 0 < sum(t["share"] for t in p["nodes"].values()) <= 1.2


# --- the command line ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["viz", "no/such/model.bin"], "no/such/model.bin"),
    (["viz", STORIES, "--mode", "sideways"], "--mode"),
    (["viz", STORIES, "--port", "99999"], "--port"),
    (["viz", STORIES, "-z", STORIES_TOK, "-c", "100000"], "--ctx"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and message in err


def test_prefill_graph_and_its_kernels(q4k):
    """``--mode prefill``: a prompt chunk of T tokens, its kernels compiled for any T."""
    from compiler.native import NativeOptions
    from runtime.tools.viz.session import VizOptions, build_session

    m = load_model(q4k, None)
    s: Session = build_session(m, VizOptions(q4k, None, "prefill", NativeOptions(ctx=32)))
    last = s.steps[-1]
    assert last.graph.name.endswith(".prefill") and [x.name for x in s.steps][1:] == list(default_pipeline("llvm"))
    mm = next(n for n in last.graph.nodes if n.op.startswith("qmatmul"))
    assert "T" in s.node_json(last, mm.output.name)["inputs"][0]["shape"]
    k = s.kernel(last, mm.output.name)
    assert k["available"] and "define" in k["ir"] and k["name"] + ":" in k["asm"]


# --- in the browser ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    if webdriver is None:
        pytest.skip("selenium is not installed (pip install selenium)")
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("Chromium and its driver are not installed (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1600,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)   # the system's: Selenium would download one
    try:
        driver = webdriver.Chrome(service=service, options=options)
    except WebDriverException as e:
        pytest.skip(f"Chromium did not start under chromedriver: {e.msg}")
    yield driver
    driver.quit()


def test_pick_a_pass_click_a_node_read_its_assembly(qviz, browser):
    d = browser
    d.get(qviz.url)
    wait_until(lambda: d.find_elements(By.CSS_SELECTOR, "#graph svg g.node[data-node]"), "the last step's picture")
    d.find_element(By.CSS_SELECTOR, "#passes li[data-step='1']").click()   # fuse_dequant
    wait_until(lambda: "fuse_dequant:" in d.find_element(By.ID, "diff-summary").text, "fuse_dequant's summary")
    fused = wait_until(lambda: d.find_elements(By.CSS_SELECTOR, "#graph g.node.viz-fused"), "fused nodes marked")
    want = {f["name"] for f in qviz.json("/api/step/1")["diff"]["fused"]}
    assert {g.get_attribute("data-node") for g in fused} <= want
    node = fused[0]
    name = node.get_attribute("data-node")
    node.find_element(By.CSS_SELECTOR, "text").click()
    wait_until(lambda: d.find_element(By.CSS_SELECTOR, "#node h2").text.startswith(f"%{name} = qmatmul[Q4_K]")
               if d.find_elements(By.CSS_SELECTOR, "#node h2") else False, "the node's panel")
    assert "fused by this pass" in d.find_element(By.ID, "node").text
    assert "viz-selected" in node.get_attribute("class")
    d.find_element(By.ID, "show-kernel").click()
    sym = qviz.json(f"/api/node/1/{name}")["signature"]["name"]
    code = wait_until(lambda: d.find_elements(By.ID, "kernel-code"), "the kernel's code", timeout=120)[0]

    def shown() -> str:   # all of the code, scrolled out of view or not
        return code.get_attribute("textContent")

    wait_until(lambda: f"{sym}:" in shown(), "the assembly", timeout=120)
    assert code.get_attribute("data-view") == "asm"
    assert re.search(r"^\s+v?[a-z]+[a-z0-9]*\s+%", shown(), re.M)   # instructions with register operands
    d.execute_script("document.getElementById('show-kernel').scrollIntoView()")
    d.save_screenshot(SCREENSHOT)
    d.find_element(By.CSS_SELECTOR, ".code-tabs button[data-view='ir']").click()
    assert re.search(rf'^define .*"{sym}"\(', shown(), re.M)
    errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
