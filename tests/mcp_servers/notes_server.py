"""A small MCP server for the tests, written with the official SDK.

    python notes_server.py                 serves MCP over stdio
    python notes_server.py --http PORT     serves streamable HTTP on 127.0.0.1:PORT/mcp
"""

from __future__ import annotations

import asyncio
import base64
import os
import sys

from mcp.server.mcpserver import Image, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("notes")

# The smallest valid PNG: one transparent pixel.
PIXEL = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)


@server.tool()
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


@server.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep for `seconds`, then say so."""
    await asyncio.sleep(seconds)
    return f"slept {seconds:g} s"


@server.tool()
def crash() -> str:
    """Kill this server's process in the middle of the call."""
    os._exit(1)


@server.tool()
def fail() -> str:
    """Always fails with a tool error."""
    raise ToolError("the notebook is locked")


@server.tool()
def pid() -> str:
    """This server's process id."""
    return str(os.getpid())


@server.tool()
def env_value(name: str) -> str:
    """The value of an environment variable of this server, or '<unset>'."""
    return os.environ.get(name, "<unset>")


@server.tool()
def picture() -> list[str | Image]:
    """A caption and a one-pixel PNG."""
    return ["a pixel:", Image(data=PIXEL, format="png")]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
