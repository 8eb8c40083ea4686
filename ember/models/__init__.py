"""Model clients behind one protocol: OpenAI-compatible endpoints and scripted models."""
