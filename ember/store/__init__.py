"""Durable state: sessions, jobs, memory and traces in one SQL database."""
