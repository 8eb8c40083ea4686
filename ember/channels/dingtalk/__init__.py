"""The DingTalk channel."""
