"""The API's routes over any backend (``runtime.serve.backend``): mounted on
an app with a stand-in that answers from a script instead of a model, they
serve the same shapes, refusals and streams as ``lmc serve`` does
(``test_serve.py`` runs the real server)."""
from __future__ import annotations

import json
import threading

from fastapi import FastAPI
from fastapi.testclient import TestClient

from runtime.engine import EngineBusy, Event, Request
from runtime.serve.app import ROUTERS, create_app
from runtime.serve.backend import ModelInfo
from runtime.serve.errors import install_error_handlers


class Words:
    def encode(self, text, bos=True, *rest):
        return ([1] if bos else []) + [len(w) for w in text.split()]

    def decode(self, ids):
        return " ".join("w" * i for i in ids)

    def chat_ids(self, messages, add_generation_prompt=True, **kw):
        return self.encode(" ".join(m["content"] for m in messages))


class Scripted:
    """A backend that answers every request with the same words, from another thread."""

    def __init__(self, words: list[str], busy: bool = False) -> None:
        self.info = ModelInfo("scripted", ctx=64, vocab=100, meta={"kind": "test"})
        self.tokenizer = Words()
        self.words, self.busy = words, busy
        self.errors: list[int] = []
        self.submitted: list[Request] = []

    def submit(self, req: Request) -> None:
        if self.busy:
            raise EngineBusy("all busy")
        self.submitted.append(req)

        def answer() -> None:
            for i, w in enumerate(self.words):
                last = i == len(self.words) - 1
                req.emit(Event(text=w, token_ids=[i], finish_reason="length" if last else None,
                               usage={"prompt_tokens": len(req.prompt_ids), "completion_tokens": i + 1,
                                      "total_tokens": len(req.prompt_ids) + i + 1} if last else None))

        threading.Thread(target=answer).start()

    def cancel(self, req_id: str) -> None:
        pass

    def metrics_text(self) -> bytes:
        return b"scripted_requests 1\n"

    def count_error(self, status: int) -> None:
        self.errors.append(status)


def test_the_routes_serve_any_backend():
    backend = Scripted(["Once", " upon", " a time"])
    c = TestClient(create_app(backend))
    assert c.get("/v1/models").json()["data"][0]["id"] == "scripted"
    r = c.post("/v1/completions", json={"prompt": "tell me", "max_tokens": 5}).json()
    assert r["choices"][0]["text"] == "Once upon a time" and r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 3 and backend.submitted[-1].prompt_ids == [1, 4, 2]
    lines = [ln for ln in c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                 "stream": True}).text.splitlines() if ln]
    assert lines[-1] == "data: [DONE]"
    deltas = [json.loads(ln[6:])["choices"][0]["delta"].get("content") for ln in lines[:-1]]
    assert "".join(d or "" for d in deltas) == "Once upon a time"
    assert c.get("/metrics").text == "scripted_requests 1\n"
    assert c.post("/detokenize", json={"tokens": [3, 100]}).status_code == 400
    assert backend.errors == [400]


def test_a_busy_backend_is_a_503_with_retry_after():
    backend = Scripted([], busy=True)
    r = TestClient(create_app(backend)).post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and "all busy" in r.json()["error"]["message"]
    assert backend.errors == [503]


def test_the_routers_mount_on_another_app():
    """What a deployment with replicas does: its own app, the same routers, its own backend."""
    app = FastAPI()
    app.state.backend = backend = Scripted(["a"])
    install_error_handlers(app, backend)
    for router in ROUTERS:
        app.include_router(router)
    c = TestClient(app)
    assert c.post("/v1/completions", json={"prompt": "x", "model": "scripted"}).json()["choices"][0]["text"] == "a"
    assert c.post("/v1/completions", json={"prompt": "x", "model": "other"}).status_code == 404
