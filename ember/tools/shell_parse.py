"""What a shell command line runs, read with bashlex so the tool policy can judge each part.

    read_command(line) -> CommandLine | None
        commands  every simple command, in source order, including those inside
                  $(…), `…`, <(…), subshells, { …; } groups, functions and
                  if/for/while/until: its assignments and words as written,
                  joined by single spaces (`FOO=1 curl 'a b'`), without redirections;
        unsafe    what the line does beyond running those commands: a redirection
                  to a file that may lie outside the workspace, or a command
                  hidden where bashlex does not look (a here-document, ${…}).
    None when bashlex cannot read the line: a syntax it lacks (arithmetic, case,
    [[ … ]]), an error, a line longer than MAX_CHARS, or one that costs more than
    its work budget (bashlex loops forever on some malformed input).

A command's `guard` is set when its words alone do not say what runs: environment
assignments in front (`LD_PRELOAD=x pytest`), a program that runs other commands
or inline code (`sh -c`, `env CMD`, `find -exec`), or a program named by a path,
a glob or an expansion. Such a command is allowed only by a rule that spells the
guard out literally (see approval.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any

import bashlex
import bashlex.ast

# Longer lines (a large here-document) are not read, so reading stays well under a second.
MAX_CHARS = 16_000
# Trace events bashlex may spend per character of the line; ordinary lines need under 70.
BUDGET_PER_CHAR = 400
BUDGET_BASE = 50_000

# Programs that run a command or code given in their arguments.
TRAMPOLINES = frozenset({
    "sh", "bash", "dash", "zsh", "ksh", "mksh", "fish", "csh", "tcsh", "busybox", "eval", "exec", "source", ".",
    "command", "builtin", "env", "xargs", "nohup", "nice", "ionice", "timeout", "time", "sudo", "doas", "su",
    "setsid", "stdbuf", "chroot", "unshare", "nsenter", "taskset", "flock", "watch", "parallel", "script",
    "strace", "ltrace", "trap", "alias", "awk", "gawk", "mawk", "nawk",
})
# ...and these when an argument starts with one of the flags that give them code inline.
INLINE_CODE = {
    "find": ("-exec", "-ok"), "python": ("-c",), "python3": ("-c",), "perl": ("-e", "-E"), "ruby": ("-e",),
    "node": ("-e", "--eval", "-p"), "php": ("-r",),
}
# Programs after which a relative redirection target is no longer in the workspace.
DIRECTORY_CHANGES = frozenset({"cd", "pushd", "popd"})
HARMLESS_TARGETS = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr"})
# Redirections whose target is not a file.
NOT_FILES = frozenset({"<<", "<<-", "<<<"})


@dataclass(frozen=True, slots=True)
class SimpleCommand:
    text: str
    guard: str = ""  # when set, what an allow rule's pattern must begin with, literally


@dataclass(frozen=True, slots=True)
class CommandLine:
    commands: tuple[SimpleCommand, ...]
    unsafe: tuple[str, ...]


class _BudgetSpent(Exception):
    """bashlex worked past the budget on one line."""


def read_command(line: str) -> CommandLine | None:
    if not line.strip() or len(line) > MAX_CHARS:
        return None
    try:
        trees = _within_budget(line, BUDGET_BASE + BUDGET_PER_CHAR * len(line))
        reader = _Reader(line)
        for tree in trees:
            reader.visit(tree)
    # bashlex's own errors, the syntax it lacks, and its internal failures on malformed input.
    except (bashlex.errors.ParsingError, NotImplementedError, _BudgetSpent, RecursionError, AttributeError,
            TypeError, ValueError, IndexError, AssertionError):
        return None
    return reader.result()


def _within_budget(line: str, budget: int) -> list[Any]:
    """bashlex.parse(line), stopped by _BudgetSpent after `budget` trace events.

    Tracing replaces the thread's tracer (a coverage tool's) for the call and restores it after.
    """
    spent = 0

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal spent
        spent += 1
        if spent > budget:
            raise _BudgetSpent
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        return bashlex.parse(line)
    finally:
        sys.settrace(previous)


class _Reader(bashlex.ast.nodevisitor):  # type: ignore[misc]
    """Collects the simple commands and the unsafe features of one line's trees."""

    def __init__(self, line: str) -> None:
        self._line = line
        self._commands: list[SimpleCommand] = []
        self._unsafe: list[str] = []
        self._file_targets: list[str] = []
        self._changes_directory = False

    def result(self) -> CommandLine:
        unsafe = list(self._unsafe)
        if self._changes_directory and any(t not in HARMLESS_TARGETS for t in self._file_targets):
            unsafe.append("a redirection after changing directory")
        return CommandLine(tuple(self._commands), tuple(unsafe))

    def _written(self, node: Any) -> str:
        return self._line[node.pos[0]:node.pos[1]]

    def visitcommand(self, node: Any, parts: list[Any]) -> None:
        words = [part for part in parts if part.kind in ("assignment", "word")]
        text = " ".join(self._written(word) for word in words)
        program = next((i for i, word in enumerate(words) if word.kind == "word"), None)
        guarded = program != 0 or (program is not None and self._runs_other_code(words[program:]))
        end = len(words) if program is None else program + 1
        guard = " ".join(self._written(word) for word in words[:end]) if guarded else ""
        self._commands.append(SimpleCommand(text, guard))
        if program is not None and words[program].word in DIRECTORY_CHANGES:
            self._changes_directory = True

    def _runs_other_code(self, words: list[Any]) -> bool:
        written = self._written(words[0])
        if any(c in written for c in "/*?[$`"):  # a path, a glob, or computed: not a name the rule can read
            return True
        name = words[0].word
        if name in TRAMPOLINES:
            return True
        flags = INLINE_CODE.get(name)
        return flags is not None and any(word.word.startswith(flags) for word in words[1:])

    def visitredirect(self, node: Any, input: Any, type: str, output: Any, heredoc: Any) -> None:
        if type in NOT_FILES or not isinstance(output, bashlex.ast.node):
            return
        self._file_targets.append(output.word)
        if _outside_workspace(self._written(output), output.word):
            self._unsafe.append(f"a redirection to {output.word}")

    def visitheredoc(self, node: Any, value: str) -> None:
        if "$(" in value or "`" in value:
            self._unsafe.append("a command inside a here-document")

    def visitparameter(self, node: Any, value: str) -> None:
        if "$(" in value or "`" in value:
            self._unsafe.append("a command inside a ${…} expansion")


def _outside_workspace(written: str, path: str) -> bool:
    """Whether a redirection's target (as written, and unquoted) may name a file outside the workspace."""
    if "$" in written or "`" in written:  # expanded when it runs: it could name anything
        return True
    if path in HARMLESS_TARGETS:
        return False
    return path.startswith(("/", "~")) or ".." in path.split("/")
