"""I4: reasoning never reaches the session, the memory or a channel."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ember.core.thinking import ThinkFilter, strip_thinking

TAGS = ("think", "thinking", "thought", "THINK", "Thinking")


def stream_through(chunks: list[str]) -> str:
    machine = ThinkFilter()
    return "".join(machine.feed(chunk) for chunk in chunks) + machine.flush()


def test_whole_block_removed() -> None:
    assert strip_thinking("<think>plan the answer</think>\n\nThe answer is 4.") == "The answer is 4."


def test_each_tag_name_is_recognised() -> None:
    for tag in TAGS:
        assert strip_thinking(f"A<{tag}>hidden</{tag}>B") == "AB"


def test_tag_split_across_deltas() -> None:
    assert stream_through(["Hi <thi", "nk>sec", "ret</th", "ink> there"]) == "Hi  there"


def test_unclosed_block_runs_to_the_end() -> None:
    assert stream_through(["Answer. <thinking>I still", " wonder whether"]) == "Answer. "


def test_lone_closing_tag_is_dropped() -> None:
    # Some providers strip the opening tag but leave the closing one.
    assert strip_thinking("reasoning leaked</think>Final") == "reasoning leakedFinal"


def test_nested_blocks_hide_everything_inside_the_outer_one() -> None:
    assert strip_thinking("<think>a<think>b</think>still hidden</think>ok") == "ok"


def test_tags_with_attributes_or_spaces() -> None:
    assert strip_thinking('<think >x</think>y') == "y"
    assert strip_thinking('a <thinking type="plan">h</thinking > b') == "a  b"
    assert stream_through(["v <thought", "\n  budget=3", ">h</thou", "ght>w"]) == "v w"


def test_text_that_only_looks_like_a_tag_start_is_kept() -> None:
    assert stream_through(["a <", "b> and <th", "e end"]) == "a <b> and <the end"
    assert stream_through(["1 <", "3"]) == "1 <3"
    assert stream_through(["ends with <thi"]) == "ends with <thi"
    assert stream_through(["1 <", " 2 and <thinker>"]) == "1 < 2 and <thinker>"


# Visible text never contains '<' so that it cannot form a tag with its neighbours.
visible = st.text(alphabet=st.characters(blacklist_characters="<>", blacklist_categories=("Cs",)), max_size=30)
hidden = st.text(alphabet=st.characters(blacklist_characters="<", blacklist_categories=("Cs",)), max_size=30)


@st.composite
def streams(draw: st.DrawFn) -> tuple[str, str, str]:
    """A text made of visible parts and think blocks, the visible text alone, and
    a secret marker that appears only inside the blocks."""
    secret = "S3CR3T"
    parts: list[str] = []
    expected: list[str] = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()):
            text = draw(visible)
            parts.append(text)
            expected.append(text)
        else:
            tag = draw(st.sampled_from(TAGS))
            parts.append(f"<{tag}>{draw(hidden)}{secret}{draw(hidden)}</{tag}>")
    if draw(st.booleans()):
        parts.append(f"<{draw(st.sampled_from(TAGS))}>{secret}{draw(hidden)}")  # unclosed at the end
    return "".join(parts), "".join(expected).lstrip(), secret


@settings(max_examples=400, deadline=None)
@given(streams(), st.data())
def test_any_split_emits_only_visible_text_in_order(case: tuple[str, str, str], data: st.DataObject) -> None:
    text, expected, secret = case
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    out = stream_through(chunks)
    assert secret not in out
    assert out == expected
    assert out == strip_thinking(text)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60), st.lists(st.integers(0, 60), max_size=8))
def test_streaming_and_whole_text_always_agree(text: str, cuts: list[int]) -> None:
    bounded = sorted(min(c, len(text)) for c in cuts)
    chunks = [text[a:b] for a, b in zip([0, *bounded], [*bounded, len(text)])]
    assert stream_through(chunks) == strip_thinking(text)
