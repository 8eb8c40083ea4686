"""MCP servers as tools: each tool of a configured server becomes `server__tool`.

`config` holds a server's settings, `connection` runs one server (its
transport, session and supervisor task), and `hub` turns the servers' tools
into Ember tools and starts and stops them all. The official SDK (`mcp`, 2.x)
is imported only when a server is connected: it takes seconds to import, which
commands without MCP servers should not pay.
"""

from ember.tools.mcp.config import McpServerConfig, McpServers
from ember.tools.mcp.connection import result_text
from ember.tools.mcp.hub import McpHub, start_mcp, tool_name

__all__ = ["McpHub", "McpServerConfig", "McpServers", "result_text", "start_mcp", "tool_name"]
