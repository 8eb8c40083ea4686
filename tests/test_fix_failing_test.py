""""Fix the failing test", end to end: a real `ember serve`, a scripted model that
reads the code, runs the tests through `shell`, edits the bug with `edit_file`
and runs them again, with every risky step under the user's policy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from tests.gatewayproc import EMBER, LaunchGateway
from tests.modelserver import ModelServer, Reply, tool_call
from tests.test_approval_channels import auth, sse

KEY = "alice-secret-0123456789"
PYTEST = f"{sys.executable} -m pytest -q -p no:cacheprovider test_calc.py"
# The sandboxed shell sees the system only: this python's venv and installation are shown to it too.
# A rule allows a program given by its path only when it names that path.
POLICY = f"""
shell_read_only_paths = ["{sys.prefix}", "{sys.base_prefix}"]
[tool_policy]
timeout_s = 30
[[tool_policy.rules]]
tool = "shell"
subject = "{sys.executable} -m pytest *"
decision = "allow"
"""


def project(root: Path) -> None:
    root.mkdir(parents=True)
    (root / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (root / "test_calc.py").write_text("from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n")


def protocol_valid(messages: list[dict[str, Any]]) -> bool:
    """Every assistant tool call is followed by exactly its results, and no result stands alone."""
    expected: list[str] = []
    for message in messages:
        if message["role"] == "tool":
            if not expected or message["tool_call_id"] != expected.pop(0):
                return False
        elif expected:
            return False
        if message["role"] == "assistant":
            expected = [call["id"] for call in message["tool_calls"]]
    return not expected


def test_the_agent_fixes_a_failing_test(launch_gateway: LaunchGateway, model_server: ModelServer,
                                         tmp_path: Path) -> None:
    home = tmp_path / "home"
    project(home / "workspaces" / "alice")
    (home / "ember.toml").write_text(POLICY)
    model_server.push(
        Reply(tool_calls=(tool_call("read_file", path="calc.py"),)),
        Reply(text="Let me run the tests.", tool_calls=(tool_call("shell", command=PYTEST),)),
        Reply(tool_calls=(tool_call("edit_file", path="calc.py", old="return a - b", new="return a + b"),)),
        Reply(tool_calls=(tool_call("shell", command=PYTEST),)),
        Reply(text="Fixed: `add` subtracted instead of adding. The test passes now."),
    )
    gateway = launch_gateway(model_server, keys={"alice": KEY}, home=home)

    events = []
    with httpx.stream("POST", gateway.url("/api/sessions/fix/messages"), headers=auth(KEY), timeout=120,
                      json={"text": "The test in my workspace fails. Fix it."}) as response:
        for kind, data in sse(response):
            events.append((kind, data))
            if kind == "approval_request":
                answer = httpx.post(gateway.url(f"/api/approvals/{data['id']}"), headers=auth(KEY),
                                    json={"decision": "approve_once"})
                assert answer.status_code == 200

    kinds = [kind for kind, _ in events]
    final = dict(events)["final"]
    assert final["text"] == "Fixed: `add` subtracted instead of adding. The test passes now."
    # Asked once, for the edit only: reads are allowed, and the policy allows running pytest.
    assert [data["tool"] for kind, data in events if kind == "approval_request"] == ["edit_file"]
    assert kinds.count("tool_call") == 4 and kinds.count("tool_result") == 4

    # What the tools told the model: the test failed, then passed.
    results = [m["content"] for m in model_server.requests[-1]["messages"] if m["role"] == "tool"]
    assert "return a - b" in results[0]
    assert "1 failed" in results[1] and "exit code: 1" in results[1]
    assert "1 passed" in results[3] and "exit code: 0" in results[3]
    assert (home / "workspaces" / "alice" / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    rerun = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_calc.py"],
                           cwd=home / "workspaces" / "alice", capture_output=True, text=True, timeout=60)
    assert rerun.returncode == 0, rerun.stdout

    history = httpx.get(gateway.url("/api/sessions/fix/messages"), headers=auth(KEY)).json()["messages"]
    assert [m["role"] for m in history] == ["user", *["assistant", "tool"] * 4, "assistant"]
    assert protocol_valid(history)

    # The trace shows each call and who allowed it.
    shown = subprocess.run([EMBER, "trace", "show", final["turn_id"]], env=gateway.env | {"COLUMNS": "250"},
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    edit_line = next(line for line in lines if "edit_file" in line)
    assert "approve_once by user:alice" in edit_line
    shell_lines = [line for line in lines if line.lstrip("│ ").startswith("shell")]
    assert len(shell_lines) == 2 and all("approve_once by policy" in line for line in shell_lines)
    assert "model call" in shown.stdout and "inference" in shown.stdout
    assert "status ok" in shown.stdout
