"""What every chat platform channel shares: streaming by edits, splitting long answers."""
