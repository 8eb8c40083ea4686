"""Memory: snapshots for prompts, consolidation into episodes, reviews, embeddings."""
