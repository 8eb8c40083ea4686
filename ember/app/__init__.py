"""The one composition root: settings to stores, models, memory, the runtime, its channels and processes."""
