"""The Feishu / Lark channel: event subscription over HTTP, answers as a card updated in place."""
