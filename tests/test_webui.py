"""The chat page of ``lmc serve`` (``/``), as a person meets it: Debian's
Chromium (headless) driven by Selenium against a real server process on
SmolLM2-135M-Instruct.

A reply is seen growing while it streams and ends with its statistics;
Stop cancels the request on the server (its /metrics say so); the
conversation and the settings outlive a reload; a server with an API key
serves the page, says plainly that the key is missing, and answers once it
is entered; ``--no-webui`` has no page. Markdown is rendered (code blocks
highlighted, with a copy button) and a reply's raw HTML stays text, never
a live element. Skips where Chromium, its driver or Selenium are not
installed (``apt-get install chromium chromium-driver``; the test extra).
"""
from __future__ import annotations

import json
import re
import shutil
import time

import httpx
import pytest

from runtime.cli import DEFAULT_MODEL, DEFAULT_TOKENIZER
from serve_process import serve, wait_until
from shared_data import SMOLLM2, instruct_models

try:
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:   # the browser tests skip (the fixture says why); the others run
    webdriver = None

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = pytest.mark.xdist_group("webui")   # the module's servers and browser on one worker

MODEL_ID = SMOLLM2.removesuffix(".gguf")
ARGS = ("-t", "1", "-c", "2048")
PROMPT = "Write a Python function that reverses a string, with a short explanation."
#: greedy, this prompt runs past 400 tokens (checked in the test itself)
LONG_PROMPT = "Write a very long, detailed essay about the history of computers, with many sections."
SCREENSHOT = "/tmp/webui_chat.png"


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def model() -> str:
    return instruct_models()[SMOLLM2]


@pytest.fixture(scope="module")
def server(model):
    with serve(model, *ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    if webdriver is None:
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("Chromium and its driver are not installed (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900"):
        options.add_argument(arg)
    # the system's driver: Selenium would otherwise try to download one
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)
    try:
        driver = webdriver.Chrome(service=service, options=options)
    except WebDriverException as e:
        pytest.skip(f"Chromium did not start under chromedriver: {e.msg}")
    yield driver
    driver.quit()


def open_page(driver, url: str, model_id: str | None = MODEL_ID) -> None:
    """The page afresh: nothing in localStorage; waits for the header's model name."""
    driver.get(f"{url}/")
    driver.execute_script("localStorage.clear()")
    driver.get(f"{url}/")
    if model_id is not None:
        wait_until(lambda: text(driver, "#model-name") == model_id, f"the model name {model_id!r} in the header")


def text(driver, selector: str) -> str:
    """The shown text of the last element ``selector`` finds ("" if none), read in one
    script: the page re-renders as a reply streams, and a found element may be gone
    by the time it is read."""
    return driver.execute_script(
        "const els = document.querySelectorAll(arguments[0]); return els.length ? els[els.length - 1].innerText : ''",
        selector)


def shown(driver, selector: str) -> bool:
    return driver.execute_script(
        "const els = document.querySelectorAll(arguments[0]); const el = els[els.length - 1];"
        "return Boolean(el) && !el.closest('[hidden]') && el.getClientRects().length > 0", selector)


def send(driver, message: str) -> None:
    box = driver.find_element(By.ID, "input")
    box.send_keys(message)
    box.send_keys(Keys.ENTER)


def settings(driver, **fields: str) -> None:
    """Open Settings, fill the fields (set-FIELD ids), save."""
    driver.find_element(By.ID, "open-settings").click()
    for name, value in fields.items():
        el = driver.find_element(By.ID, f"set-{name.replace('_', '-')}")
        el.clear()
        el.send_keys(value)
    driver.find_element(By.ID, "settings-save").click()


def reply_state(driver) -> dict:
    """The last reply's text and statistics, in one round trip (fast polls)."""
    return driver.execute_script("""
        const r = [...document.querySelectorAll('article.message.assistant')].pop();
        return r ? {text: r.querySelector('.content').textContent, stats: r.querySelector('.stats').textContent}
                 : {text: null, stats: ''};""")


def finished_reply(driver, timeout: float = 120.0) -> dict:
    return wait_until(lambda: (s := reply_state(driver))["stats"] and s, "the reply's statistics", timeout)


STATS = re.compile(r"(~?)(\d+) tokens? · ([\d.]+) tok/s · TTFT (\d+) ms")


def test_a_reply_streams_token_by_token_and_ends_with_its_statistics(server, browser):
    d = browser
    open_page(d, server.url)
    assert text(d, "#model-ctx") == "context 2048"
    settings(d, temperature="0", max_tokens="300")   # greedy: a reply of its own length, in bounded time
    before = metric(server.url, "lmc_generated_tokens_total")
    send(d, PROMPT)
    assert wait_until(lambda: text(d, "article.message.user .content"), "the message shown") == PROMPT
    assert shown(d, "#stop") and not shown(d, "#send")

    seen = []   # the reply's length each time a poll found it changed, while it streams
    deadline = time.monotonic() + 120
    while not (state := reply_state(d))["stats"]:
        if state["text"] and (not seen or len(state["text"]) != seen[-1]):
            seen.append(len(state["text"]))
        assert time.monotonic() < deadline, "the reply never finished"
        time.sleep(0.02)
    assert len(seen) >= 3, f"the reply did not grow while streaming (lengths seen: {seen})"
    assert seen[0] < len(state["text"]), "the first text seen was a part of the reply"

    m = STATS.search(state["stats"])
    assert m, state["stats"]
    tokens = int(m.group(2))
    assert m.group(1) == "" and tokens > 0 and float(m.group(3)) > 0 and int(m.group(4)) >= 0
    # the count under the reply is the server's
    assert metric(server.url, "lmc_generated_tokens_total") - before == tokens
    assert re.search(r"context \d+ / 2048", state["stats"]), state["stats"]
    assert shown(d, "#send") and not shown(d, "#stop")
    assert text(d, "#conversations li.active button.open") == PROMPT[:57] + "…"   # the title: its start
    d.save_screenshot(SCREENSHOT)


def test_stop_cancels_the_request_on_the_server(server, browser):
    d = browser
    open_page(d, server.url)
    settings(d, temperature="0", max_tokens="400")
    before = metric(server.url, "lmc_generated_tokens_total")
    send(d, LONG_PROMPT)
    wait_until(lambda: reply_state(d)["text"], "the first streamed text")
    d.find_element(By.ID, "stop").click()

    wait_until(lambda: shown(d, "#send") and not shown(d, "#stop"), "the Send button back")
    state = reply_state(d)
    assert "stopped" in state["stats"], state["stats"]
    assert state["stats"].startswith("~"), "a stopped reply counts its streamed pieces"
    wait_until(lambda: metric(server.url, "lmc_running_sequences") == 0, "the server to drop the sequence", 30)
    generated = metric(server.url, "lmc_generated_tokens_total") - before
    assert 0 < generated < 400, generated
    print(f"stopped after {generated:g} tokens")
    # it stays stopped: no more text, no more tokens
    assert reply_state(d)["text"] == state["text"]
    assert metric(server.url, "lmc_generated_tokens_total") - before == generated

    # the same request, not stopped, would have run to max_tokens
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": LONG_PROMPT}], "temperature": 0, "top_p": 0.95, "max_tokens": 400})
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_the_conversation_and_settings_outlive_a_reload(server, browser):
    d = browser
    open_page(d, server.url)
    settings(d, max_tokens="24", system="You are terse.")
    send(d, "Name three colours.")
    first = finished_reply(d)
    d.refresh()
    wait_until(lambda: text(d, "#model-name") == MODEL_ID, "the header after the reload")
    assert text(d, "article.message.user .content") == "Name three colours."
    assert reply_state(d) == first
    assert text(d, "#conversations li.active button.open") == "Name three colours."
    d.find_element(By.ID, "open-settings").click()
    assert d.find_element(By.ID, "set-max-tokens").get_attribute("value") == "24"
    assert d.find_element(By.ID, "set-system").get_attribute("value") == "You are terse."
    d.find_element(By.ID, "settings-cancel").click()

    # a second conversation; switching back; deleting one
    d.find_element(By.ID, "new-chat").click()
    assert not d.find_elements(By.CSS_SELECTOR, "article.message")
    send(d, "Say hello.")
    finished_reply(d)
    titles = [e.text for e in d.find_elements(By.CSS_SELECTOR, "#conversations li button.open")]
    assert titles == ["Say hello.", "Name three colours."]
    d.find_elements(By.CSS_SELECTOR, "#conversations li button.open")[1].click()
    assert text(d, "article.message.user .content") == "Name three colours."
    assert reply_state(d) == first
    d.find_element(By.CSS_SELECTOR, "#conversations li.active button.delete").click()
    WebDriverWait(d, 10).until(expected_conditions.alert_is_present()).accept()
    assert [e.text for e in d.find_elements(By.CSS_SELECTOR, "#conversations li button.open")] == ["Say hello."]
    assert not d.find_elements(By.CSS_SELECTOR, "article.message")
    d.refresh()
    wait_until(lambda: text(d, "#model-name") == MODEL_ID, "the header after the reload")
    assert [e.text for e in d.find_elements(By.CSS_SELECTOR, "#conversations li button.open")] == ["Say hello."]


def test_a_refused_request_is_shown_plainly_and_the_message_kept(server, browser):
    d = browser
    open_page(d, server.url)
    settings(d, max_tokens="2048")   # with the prompt, more than the context
    send(d, "Hi there")
    banner = wait_until(lambda: shown(d, "#banner") and text(d, "#banner"), "the error banner")
    assert banner.startswith("HTTP 400: the context is 2048 tokens"), banner
    assert "lower max_tokens" in banner
    assert d.find_element(By.ID, "input").get_attribute("value") == "Hi there"
    assert not d.find_elements(By.CSS_SELECTOR, "article.message")
    assert not d.find_elements(By.CSS_SELECTOR, "#conversations li")
    assert shown(d, "#send") and not shown(d, "#stop")


def test_a_huge_message_is_refused_plainly_and_the_server_stays_up(server, browser):
    """9 MiB pasted into the box: the server refuses the body (413) before
    reading it whole, the page says so, and the next message is answered."""
    d = browser
    open_page(d, server.url)
    d.execute_script("document.getElementById('input').value = 'x'.repeat(9 << 20)")
    d.find_element(By.ID, "send").click()
    banner = wait_until(lambda: shown(d, "#banner") and text(d, "#banner"), "the error banner")
    assert banner.startswith("HTTP 413: the request body is larger than 8 MiB"), banner[:200]
    assert httpx.get(f"{server.url}/health").status_code == 200
    d.execute_script("document.getElementById('input').value = ''")
    settings(d, temperature="0", max_tokens="8")
    send(d, "Hi")
    assert finished_reply(d)["text"]


def test_settings_refuse_values_out_of_range(server, browser):
    d = browser
    open_page(d, server.url)
    settings(d, temperature="5")
    error = d.find_element(By.ID, "settings-error")
    assert error.is_displayed() and error.text == 'Temperature must be a number from 0 to 2, not "5".'
    assert d.find_element(By.ID, "settings").get_attribute("open") is not None, "the dialog stays open"
    d.find_element(By.ID, "settings-cancel").click()
    assert d.execute_script("return localStorage.getItem('lmc.settings')") is None


ASSISTANT_MARKDOWN = (
    "Here is code:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\n"
    "And **bold**, then <script>window.pwned = 'script'</script> and "
    "<img src=x onerror=\"window.pwned = 'img'\"> and [a link](javascript:window.pwned='link')."
)


def test_markdown_is_rendered_and_raw_html_stays_text(server, browser):
    d = browser
    open_page(d, server.url)
    conv = {"id": "c1", "title": "markdown", "updated": 1, "messages": [
        {"role": "user", "content": "**not bold** <b>typed</b>"},
        {"role": "assistant", "content": ASSISTANT_MARKDOWN,
         "stats": {"tokens": 40, "exact": True, "finish": "stop", "ttft_ms": 12, "tok_s": 50.0}}]}
    d.execute_script("localStorage.setItem('lmc.conversations', arguments[0]);"
                     "localStorage.setItem('lmc.current', 'c1');", json.dumps([conv]))
    d.refresh()
    wait_until(lambda: d.find_elements(By.CSS_SELECTOR, "article.message.assistant"), "the stored reply")

    code = d.find_element(By.CSS_SELECTOR, "article.message.assistant pre > code")
    assert code.text == "def add(a, b):\n    return a + b"
    assert "hljs" in code.get_attribute("class") and "language-python" in code.get_attribute("class")
    assert code.find_elements(By.CSS_SELECTOR, "span.hljs-keyword"), "highlighted"
    assert d.find_element(By.CSS_SELECTOR, "article.message.assistant pre > button.copy-code").text == "Copy"
    assert d.find_element(By.CSS_SELECTOR, "article.message.assistant strong").text == "bold"

    content = d.find_element(By.CSS_SELECTOR, "article.message.assistant .content")
    assert "<script>window.pwned = 'script'</script>" in content.text   # shown as the text it is
    assert '<img src=x onerror="window.pwned = \'img\'">' in content.text
    assert not content.find_elements(By.CSS_SELECTOR, "script, img, [onerror]")
    link = content.find_element(By.LINK_TEXT, "a link")
    assert not (link.get_attribute("href") or "").startswith("javascript:")
    link.click()
    assert d.execute_script("return window.pwned === undefined")

    user = d.find_element(By.CSS_SELECTOR, "article.message.user .content")
    assert user.text == "**not bold** <b>typed</b>" and not user.find_elements(By.CSS_SELECTOR, "b, strong")
    assert text(d, "article.message.assistant .stats") == "40 tokens · 50.0 tok/s · TTFT 12 ms"


def test_with_an_api_key_the_page_loads_and_asks_for_it(model, browser):
    d = browser
    with serve(model, *ARGS, "--api-key", "K") as s:
        for path in ("/", "/webui/app.js", "/webui/style.css", "/webui/vendor/marked/marked.umd.js"):
            assert httpx.get(f"{s.url}{path}").status_code == 200, path
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(f"{s.url}{path}").status_code == 401, path

        open_page(d, s.url, model_id=None)
        banner = wait_until(lambda: shown(d, "#banner") and text(d, "#banner"), "the 401 message")
        assert banner.startswith("This server needs an API key: enter it in Settings (HTTP 401"), banner
        assert text(d, "#model-name") == "(model unknown)"
        send(d, "Hello")   # without the key: refused, said so, the message kept
        wait_until(lambda: d.find_element(By.ID, "input").get_attribute("value") == "Hello", "the message back")
        assert text(d, "#banner").startswith("This server needs an API key")
        assert not d.find_elements(By.CSS_SELECTOR, "article.message")

        settings(d, api_key="wrong")
        wait_until(lambda: text(d, "#banner").startswith("The API key in Settings was refused (HTTP 401"),
                   "the wrong key refused")
        settings(d, api_key="K")
        wait_until(lambda: text(d, "#model-name") == MODEL_ID, "the model name once the key is entered")
        assert not shown(d, "#banner")
        d.find_element(By.ID, "send").click()   # the message still in the box
        state = finished_reply(d)
        assert state["text"] and STATS.search(state["stats"]), state
        assert d.execute_script("return JSON.parse(localStorage.getItem('lmc.settings')).api_key") == "K"


def test_no_webui_has_no_page():
    with serve(str(DEFAULT_MODEL), "-z", str(DEFAULT_TOKENIZER), "-t", "1", "-c", "256", "--no-webui") as s:
        r = httpx.get(f"{s.url}/")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert httpx.get(f"{s.url}/webui/app.js").status_code == 404
        assert httpx.get(f"{s.url}/v1/models").status_code == 200


def test_the_page_and_every_file_it_links_are_served(server):
    r = httpx.get(f"{server.url}/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in r.headers["content-security-policy"]
    linked = re.findall(r'(?:src|href)="(webui/[^"]+)"', r.text)
    assert len(linked) >= 6, linked
    for path in linked:
        asset = httpx.get(f"{server.url}/{path}")
        assert asset.status_code == 200 and asset.content, path
    assert httpx.get(f"{server.url}/webui/missing.js").status_code == 404


class _Stub:
    """The least backend the app needs for these paths (no model)."""

    def __init__(self) -> None:
        from runtime.serve.backend import ModelInfo

        self.info = ModelInfo("stub", ctx=64, vocab=10, meta={"n_ctx": 64})
        self.errors: list[int] = []

    def count_error(self, status: int) -> None:
        self.errors.append(status)


def test_only_the_pages_files_skip_the_api_key():
    from fastapi.testclient import TestClient

    from runtime.serve.app import create_app

    c = TestClient(create_app(_Stub(), api_key="K"))
    for path in ("/", "/webui/app.js", "/webui/vendor/dompurify/purify.min.js"):
        assert c.get(path).status_code == 200, path
    for path in ("/v1/models", "/metrics", "/webui", "/webuix/app.js", "/index.html"):
        r = c.get(path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
    assert c.get("/v1/models", headers={"Authorization": "Bearer K"}).json()["data"][0]["id"] == "stub"
    assert c.get("/webui/%2e%2e/app.py").status_code == 404   # nothing outside the page's folder

    off = TestClient(create_app(_Stub(), api_key="K", webui=False))
    assert off.get("/").status_code == 401 and off.get("/webui/app.js").status_code == 401
    off = TestClient(create_app(_Stub(), webui=False))
    assert off.get("/").status_code == 404 and off.get("/webui/app.js").status_code == 404


def test_each_vendored_library_has_its_license_and_is_listed():
    from runtime.serve.routes_webui import WEBUI_DIR

    vendor = WEBUI_DIR / "vendor"
    readme = (vendor / "README.md").read_text()
    libraries = [p for p in vendor.iterdir() if p.is_dir()]
    assert {p.name for p in libraries} == {"marked", "dompurify", "highlight.js"}
    for lib in libraries:
        assert any(f.name.startswith("LICENSE") for f in lib.iterdir()), lib
        assert f"`{lib.name}/`" in readme, lib
