"""The pieces every chat platform shares (channels/chat/): who may talk, what a stranger is told
and when, and the bounded memory of ids a platform may send twice."""

from __future__ import annotations

from ember.channels.chat.inbound import AllowList, refusal, remember


def test_an_allow_list_lets_in_the_people_it_names_and_tells_a_stranger_once() -> None:
    gate: AllowList[str] = AllowList("qq", ["ana", "ben"])
    assert not gate.everyone
    assert gate.admits("ana") and gate.admits("ben") and not gate.admits("eve")
    assert [gate.first_refusal("eve") for _ in range(3)] == [True, False, False]
    assert gate.first_refusal("mallory")  # each stranger is told once


def test_an_empty_allow_list_lets_everyone_in_unless_it_refuses_when_empty() -> None:
    open_gate: AllowList[str] = AllowList("wecom", [])
    assert open_gate.everyone and open_gate.admits("anyone")
    closed: AllowList[int] = AllowList("telegram", [], empty_refuses=True)
    assert not closed.everyone and not closed.admits(42)


def test_a_refusal_names_the_id_the_owner_needs() -> None:
    assert refusal("Telegram user id", 42).endswith("send them your Telegram user id: 42.")


def test_remembered_ids_keep_the_latest_and_forget_the_oldest_first() -> None:
    kept: dict[str, int] = {}
    for number in range(10):
        remember(kept, f"m{number}", number, limit=4)
    assert list(kept) == ["m6", "m7", "m8", "m9"]
    remember(kept, "m7", 70, limit=4)  # seen again: kept, with its new value
    assert kept["m7"] == 70 and len(kept) == 4
