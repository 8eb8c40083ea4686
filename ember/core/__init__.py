"""Plain data shared by every part of Ember. Nothing here does I/O."""
