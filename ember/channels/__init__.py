"""Channel adapters: how users reach the agent."""
