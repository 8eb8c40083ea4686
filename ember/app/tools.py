"""The tools a runtime gives its model: the built-in ones, each person's workspace, the shell's
sandbox, and the tools of the MCP servers that started."""

from __future__ import annotations

from ember.config.settings import Settings
from ember.memory.service import MemoryService
from ember.skills.library import SkillLibrary
from ember.store.protocols import TaskBook
from ember.tools.a2a import a2a_tools
from ember.tools.base import ToolRegistry
from ember.tools.browser import BrowserPool, BrowserTool, browser_tool
from ember.tools.files import file_tools
from ember.tools.mcp import McpHub
from ember.tools.memory import memory_tools
from ember.tools.sandboxes import SandboxChoice, sandbox_choice
from ember.tools.send_file import FileKeeper, send_file_tool
from ember.tools.shell import shell_tool
from ember.tools.skills import skill_tools
from ember.tools.tasks import task_tools
from ember.tools.web import web_fetch_tool
from ember.tools.workspace import SessionOwners, Workspaces


def shell_sandbox(settings: Settings) -> SandboxChoice:
    """Where shell commands run; Ember's home and the workspaces do not exist inside."""
    read_only = [path.expanduser() for path in settings.shell_read_only_paths]
    return sandbox_choice(settings.shell_sandbox, hidden=(settings.home_dir, settings.workspace_dir),
                          read_only=read_only, docker_image=settings.shell_docker_image)


def default_tools(settings: Settings, mcp: McpHub, memory: MemoryService, tasks: TaskBook,
                  skills: SkillLibrary, sessions: FileKeeper, browser: BrowserTool | None = None) -> ToolRegistry:
    """The built-in tools, the browser if it is on, and the tools of the MCP servers that started."""
    folders = workspaces(settings, memory)
    return ToolRegistry([
        *file_tools(folders),
        send_file_tool(folders, sessions, settings.attachment_max_bytes),
        shell_tool(folders, sandbox=shell_sandbox(settings), network=settings.shell_network,
                   timeout_s=settings.shell_timeout_s, output_cap=settings.shell_output_chars,
                   env_names=settings.shell_env),
        web_fetch_tool(allow_private=settings.web_fetch_allow_private,
                       allowed_hosts=frozenset(settings.web_fetch_allowed_hosts)),
        *memory_tools(memory),
        *skill_tools(skills, folders),
        *task_tools(tasks, default_tz=settings.timezone),
        *a2a_tools(settings.a2a_agents, allow_private=settings.web_fetch_allow_private,
                   allowed_hosts=frozenset(settings.web_fetch_allowed_hosts)),
        *([browser] if browser is not None else []),
        *mcp.tools(),
    ])


def browser(settings: Settings, owners: SessionOwners) -> tuple[BrowserTool, BrowserPool] | None:
    """The browser tool and the Chromium it drives, when `[browser] enabled`; ConfigError when it cannot run."""
    if not settings.browser.enabled:
        return None
    return browser_tool(settings.browser, workspaces(settings, owners), allow_private=settings.web_fetch_allow_private,
                        allowed_hosts=frozenset(settings.web_fetch_allowed_hosts))


def workspaces(settings: Settings, owners: SessionOwners | None) -> Workspaces:
    """Each identity's own folder (`workspace` for `local`), or one for all (workspace_scope = "shared")."""
    per_identity = settings.workspaces_dir if settings.workspace_scope == "identity" else None
    return Workspaces(settings.workspace_dir, per_identity, owners=owners)
