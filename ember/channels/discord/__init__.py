"""The Discord channel: the Gateway in, answers streamed by message edits."""
