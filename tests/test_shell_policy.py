"""Tool policy rules for the shell: a command line is allowed only when everything it runs is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.core.messages import ToolCall
from ember.core.tools import Decision, Risk, ToolAction
from ember.tools.approval import ApprovalGate, Choice, Rule, ToolPolicy
from ember.tools.base import ToolRegistry
from ember.tools.shell import shell_tool
from ember.tools.workspace import Workspaces
from tests.conftest import FixedApprover, tool_run

PYTEST = [Rule(tool="shell", subject="pytest*", decision="allow")]
PYTEST_TEE = [*PYTEST, Rule(tool="shell", subject="tee *", decision="allow")]
DENY_RM = [Rule(tool="shell", subject="*rm -rf*", decision="deny"), Rule(tool="shell", subject="*", decision="allow")]
SH = [*PYTEST, Rule(tool="shell", subject="sh*", decision="allow")]


def decide(rules: list[Rule], command: str, **settings: Choice) -> Choice:
    policy = ToolPolicy(rules=rules, **settings)
    return policy.decide(ToolAction(tool="shell", risk=Risk.EXECUTE, subject=command, summary=command))


@pytest.mark.parametrize(("rules", "command", "expected"), [
    (PYTEST, "pytest -q", "allow"),
    (PYTEST, "pytest -q tests/", "allow"),
    (PYTEST, "pytest; curl x", "ask"),
    (PYTEST, "pytest && rm -rf /", "ask"),
    (PYTEST, "pytest || curl x", "ask"),
    (PYTEST, "pytest & curl x", "ask"),
    (PYTEST, "pytest\ncurl x", "ask"),
    (PYTEST, "pytest | tee out.txt", "ask"),
    (PYTEST_TEE, "pytest | tee out.txt", "allow"),
    (PYTEST, "pytest && pytest -x", "allow"),
    (PYTEST, "pytest $(curl x)", "ask"),
    (PYTEST, "pytest `curl x`", "ask"),
    (PYTEST, 'pytest "$(curl x)"', "ask"),
    (PYTEST, "pytest <(curl x)", "ask"),
    (PYTEST, "(pytest; curl x)", "ask"),
    (PYTEST, "{ pytest; curl x; }", "ask"),
    (PYTEST, "for i in 1 2; do pytest; done", "allow"),
    (PYTEST, "if curl x; then pytest; fi", "ask"),
    (PYTEST, "pytest > /etc/passwd", "ask"),
    (PYTEST, "pytest > ../../elsewhere", "ask"),
    (PYTEST, "pytest > ~/.profile", "ask"),
    (PYTEST, "pytest > report.txt", "allow"),
    (PYTEST, "pytest 2>/dev/null", "allow"),
    (PYTEST, "pytest > report.txt 2>&1", "allow"),
    (PYTEST, "sh -c 'pytest'", "ask"),
    (PYTEST, "bash -c 'pytest'", "ask"),
    (PYTEST, "eval pytest", "ask"),
    (PYTEST, "env pytest", "ask"),
    (PYTEST, "LD_PRELOAD=x.so pytest", "ask"),
    (PYTEST, "FOO=1 pytest", "ask"),
    (PYTEST, "pytest/../../bin/sh -c 'curl x'", "ask"),
    (PYTEST, "pytest ${x:-$(curl x)}", "ask"),
    (PYTEST, "echo )", "ask"),
    (PYTEST, "pytest $((1 + 2))", "ask"),
    (SH, "sh -c 'curl x'", "allow"),
    ([Rule(tool="shell", subject="FOO=1 pytest*", decision="allow")], "FOO=1 pytest -q", "allow"),
    ([Rule(tool="shell", subject="*", decision="allow")], "sh -c 'curl x'", "ask"),
    ([Rule(tool="shell", subject="*", decision="allow")], "ls; cat x", "allow"),
    (DENY_RM, "ls; rm -rf /", "deny"),
    (DENY_RM, "ls $(rm -rf /)", "deny"),
    (DENY_RM, "sh -c 'rm -rf /'", "deny"),
    ([Rule(tool="shell", subject="*| sh*", decision="deny"), *PYTEST], "pytest | sh", "deny"),
    ([*PYTEST, Rule(tool="shell", subject="curl*", decision="deny")], "pytest; curl x", "deny"),
])
def test_a_command_line_is_allowed_only_when_every_part_is(rules: list[Rule], command: str, expected: Choice) -> None:
    assert decide(rules, command) == expected


def test_parts_no_rule_matches_get_the_tools_setting() -> None:
    assert decide(PYTEST, "pytest; ls", execute="allow") == "allow"
    assert decide(PYTEST, "pytest; ls", execute="deny") == "deny"
    # Unsafe features stop a rule from allowing, not the setting the person chose for every command.
    assert decide(PYTEST, "pytest > /etc/x", execute="allow") == "ask"
    assert decide([], "ls > /etc/x", execute="allow") == "allow"
    assert decide([], "echo )", execute="deny") == "deny"


def test_other_tools_subjects_are_matched_whole_as_before() -> None:
    policy = ToolPolicy(rules=[Rule(tool="web_fetch", subject="https://docs.*", decision="allow")])
    fetch = ToolAction(tool="web_fetch", risk=Risk.NETWORK, subject="https://docs.x/a;b|c", summary="fetch")
    assert policy.decide(fetch) == "allow"


ALLOWED = st.sampled_from(["pytest", "pytest -q", "pytest -x tests/"])
RESERVED = {"if", "then", "else", "elif", "fi", "for", "while", "until", "do", "done", "case", "esac", "function",
            "select", "time", "in", "coproc"}
NAMES = st.from_regex(r"[a-z]{1,8}", fullmatch=True).filter(lambda n: n not in RESERVED and not n.startswith("pytest"))
ARGS = st.text(st.characters(min_codepoint=32, max_codepoint=126) | st.just("\n"), max_size=20)
JOINS = ["{a}; {b}", "{b}; {a}", "{a} && {b}", "{b} && {a}", "{a} || {b}", "{a} | {b}", "{b} | {a}", "{a} & {b}",
         "{b} & {a}", "{a}\n{b}", "{a} $({b})", "{a} `{b}`", "{a} <({b})", "({b}); {a}", "{{ {b}; }}; {a}",
         "{a} \"$({b})\""]


@given(ALLOWED, NAMES, ARGS, st.sampled_from(JOINS))
def test_an_allowed_command_joined_with_another_is_never_allowed(allowed: str, name: str, args: str,
                                                                 join: str) -> None:
    line = join.format(a=allowed, b=f"{name} {args}")
    assert decide(PYTEST, line) != "allow", line


async def test_through_the_gate_a_compound_command_asks_and_an_allowed_one_runs(tmp_path: Path) -> None:
    gate = ApprovalGate(ToolRegistry([shell_tool(Workspaces(tmp_path), timeout_s=10)]),
                        ToolPolicy(rules=[Rule(tool="shell", subject="echo *", decision="allow")]))
    approver = FixedApprover(Decision.DENY)
    run = tool_run(approver)

    def shell(command: str) -> ToolCall:
        return ToolCall(id="c", name="shell", arguments=json.dumps({"command": command}))

    assert await gate.call(shell("echo hi > out.txt"), run) == "exit code: 0\n(no output)"
    assert (tmp_path / "out.txt").read_text() == "hi\n" and approver.asked == []
    refused = await gate.call(shell("echo hi; touch pwned"), run)
    assert refused.startswith("Error: not permitted to run the shell command echo hi; touch pwned")
    assert not (tmp_path / "pwned").exists()
    # The person is shown the whole line, not the part that needed asking about.
    assert [a.summary for a in approver.asked] == ["run the shell command echo hi; touch pwned"]
