"""Settings: ember.toml, the environment and flags, checked once, with errors a person can act on."""
