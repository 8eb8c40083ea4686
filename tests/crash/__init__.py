"""Crash tests: `ember serve` killed with SIGKILL at chosen moments under concurrent clients."""
