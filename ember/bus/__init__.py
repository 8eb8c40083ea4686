"""How events travel between channels and the agent loop."""
