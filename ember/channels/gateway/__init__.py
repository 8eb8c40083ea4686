"""The HTTP channel: OpenAI-compatible and native APIs and the web chat page, on one port."""
