"""The embedded store: one SQLite file, with its sqlite3 fast path (direct.py)."""
