"""``lmc serve``'s compiler viewer at ``/viz/``: ``lmc viz``'s page and API
for the served model, built at the first request, through a real server
process on SmolLM2-135M-Instruct; under ``--api-key`` the page loads
without the key and its API needs it; ``--no-webui`` has no viewer. In
headless Chromium (where installed), the chat page's header link opens it."""
from __future__ import annotations

import re

import httpx
import pytest

from compiler.pipeline import default_pipeline
from serve_process import serve
from test_webui import ARGS, _Stub, browser, model, wait_until  # noqa: F401 (fixtures)

try:
    from selenium.webdriver.common.by import By
except ImportError:
    By = None

pytestmark = pytest.mark.xdist_group("webui")   # its servers and browser on test_webui's worker


@pytest.fixture(scope="module")
def server(model):
    with serve(model, *ARGS) as s:
        yield s


def get(url: str, **kw) -> httpx.Response:
    return httpx.get(url, timeout=300, **kw)


def test_viz_is_the_viewers_page_and_api(server):
    r = get(f"{server.url}/viz/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<title>lmc viz</title>" in r.text and "script-src 'self'" in r.headers["content-security-policy"]
    for path in re.findall(r'(?:src|href)="(static/[^"]+)"', r.text):
        assert get(f"{server.url}/viz/{path}").status_code == 200, path
    r = get(f"{server.url}/viz", follow_redirects=False)
    assert r.status_code in (301, 302, 307, 308) and httpx.URL(f"{server.url}/viz").join(
        r.headers["location"]).path == "/viz/"

    passes = get(f"{server.url}/viz/api/passes").json()
    assert [p["name"] for p in passes] == ["frontend", *default_pipeline("llvm")]
    info = get(f"{server.url}/viz/api/info").json()
    assert info["ctx"] == 2048 and info["steps"] == len(passes)

    last = passes[-1]["index"]
    rope = next(n for n in get(f"{server.url}/viz/api/step/{last}").json()["nodes"] if n["op"] == "rope")
    k = get(f"{server.url}/viz/api/kernel/{last}/{rope['name']}").json()
    assert k["available"] and re.search(rf"^{k['name']}:$", k["asm"], re.M)
    assert get(f"{server.url}/viz/api/step/999").status_code == 404
    assert get(f"{server.url}/v1/models").status_code == 200   # the server still serves


def test_with_an_api_key_the_viewers_page_loads_and_its_api_needs_it(model):
    with serve(model, *ARGS, "--api-key", "K") as s:
        for path in ("/viz/", "/viz/static/viz.js", "/viz/static/viz.css"):
            assert get(f"{s.url}{path}").status_code == 200, path
        for path in ("/viz/api/passes", "/viz/api/info"):
            assert get(f"{s.url}{path}").status_code == 401, path
        r = get(f"{s.url}/viz/api/passes", headers={"Authorization": "Bearer K"})
        assert r.status_code == 200 and r.json()[0]["name"] == "frontend"


def test_no_webui_has_no_viewer(model):
    with serve(model, *ARGS, "--no-webui") as s:
        assert get(f"{s.url}/viz/").status_code == 404
        assert get(f"{s.url}/viz/api/passes").status_code == 404


def test_a_viewer_that_cannot_be_built_is_a_json_500_and_the_server_stays_up():
    from fastapi.testclient import TestClient

    from runtime.serve.app import create_app

    calls = []

    def fail():
        calls.append(1)
        raise RuntimeError("no such model")

    c = TestClient(create_app(_Stub(), api_key="K", viz=fail))
    assert c.get("/viz", follow_redirects=False).status_code == 307   # the redirect, without the key
    assert c.get("/viz/api/passes").status_code == 401 and not calls   # the API needs the key
    for path in ("/viz/", "/viz/api/passes"):
        r = c.get(path, headers={"Authorization": "Bearer K"})
        assert r.status_code == 500 and "no such model" in r.json()["error"], path
    assert calls == [1]   # tried once
    assert c.get("/v1/models", headers={"Authorization": "Bearer K"}).status_code == 200
    for path in ("/vizx", "/viz/apix", "/viz/static/../api/passes"):
        assert c.get(path).status_code == 401, path   # only the page's files skip the key


def test_the_header_link_opens_the_viewer(server, browser):
    d = browser
    d.get(f"{server.url}/")
    d.execute_script("localStorage.clear()")
    d.get(f"{server.url}/")
    link = d.find_element(By.ID, "viz-link")
    assert link.get_attribute("target") == "_blank"
    tabs = set(d.window_handles)
    link.click()
    new = wait_until(lambda: set(d.window_handles) - tabs, "the viewer's tab")
    chat = d.current_window_handle
    d.switch_to.window(new.pop())
    try:
        assert d.current_url == f"{server.url}/viz/"
        items = wait_until(lambda: d.find_elements(By.CSS_SELECTOR, "#passes li"), "the pass list", timeout=120)
        assert len(items) == 1 + len(default_pipeline("llvm"))
    finally:
        d.close()
        d.switch_to.window(chat)
