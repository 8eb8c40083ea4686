"""The agent loop and what it owns: leases, background jobs, stream publishing."""
