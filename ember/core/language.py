"""The language a message is written in, as far as an introduction needs to know: its script."""

from __future__ import annotations

import unicodedata

# Scripts that name their language well enough to pick an introduction by; anything else is "en".
_SCRIPTS = (("HIRAGANA", "ja"), ("KATAKANA", "ja"), ("HANGUL", "ko"), ("CJK", "zh"), ("CYRILLIC", "ru"),
            ("ARABIC", "ar"), ("HEBREW", "he"), ("GREEK", "el"), ("THAI", "th"), ("DEVANAGARI", "hi"))


# A message's language shows in its opening: a pasted megabyte is not read to the end for it.
SAMPLE_CHARS = 2_000


def language_of(text: str) -> str:
    """The language most of `text`'s letters are written in: Japanese when it has kana at all
    (Japanese mixes kana with Chinese characters), else the commonest script; "en" for Latin."""
    counts: dict[str, int] = {}
    for char in text[:SAMPLE_CHARS]:
        if not char.isalpha():
            continue
        name = unicodedata.name(char, "")
        language = next((lang for script, lang in _SCRIPTS if name.startswith(script)), "en")
        counts[language] = counts.get(language, 0) + 1
    if counts.get("ja"):
        return "ja"
    return max(counts, key=counts.__getitem__) if counts else "en"
