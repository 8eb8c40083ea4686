"""Skills: what the agent learns to do, from the turns where it did it."""
