"""What every chat platform does to an answer's text: split where a reader would, and shown
plain where the platform renders no Markdown."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ember.channels.chat.plain import plain_text
from ember.channels.chat.split import split_message


def test_a_long_answer_is_cut_at_paragraphs_then_sentences_then_spaces() -> None:
    paragraphs = ["First paragraph. " * 30, "Second paragraph. " * 30]
    assert split_message("\n\n".join(p.strip() for p in paragraphs), 600) == [p.strip() for p in paragraphs]
    sentences = "这是第一句。" * 100 + "这是最后一句。"
    pieces = split_message(sentences, 200)
    assert all(len(p) <= 200 and p.endswith("。") for p in pieces[:-1]) and "".join(pieces) == sentences
    assert split_message("x" * 250, 100) == ["x" * 100, "x" * 100, "x" * 50]  # no break anywhere: a hard cut


@given(st.text(alphabet=st.sampled_from("ab .\n。"), max_size=2_000), st.integers(min_value=20, max_value=500))
def test_pieces_fit_and_lose_nothing_but_whitespace(text: str, limit: int) -> None:
    pieces = split_message(text, limit)
    assert all(len(piece) <= limit for piece in pieces)
    assert "".join(pieces).replace(" ", "").replace("\n", "") == text.replace(" ", "").replace("\n", "")


def test_markdown_is_shown_as_a_reader_would_read_it() -> None:
    markdown = "# Plan\n**Bold** and `code` and [docs](https://example.com/a) and snake_case and 2*3\n```py\nx = 1\n```"
    assert plain_text(markdown) == "Plan\nBold and code and docs (https://example.com/a) and snake_case and 2*3\nx = 1"
