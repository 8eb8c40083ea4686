"""The three stages of a turn: context, inference, response (the commit boundary)."""
