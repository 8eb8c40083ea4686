"""Telegram: a bot polled or called back, streaming by edits, approvals by buttons."""
