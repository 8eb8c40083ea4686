"""Kinds of durable background work a turn may schedule."""

import enum


class JobKind(enum.StrEnum):
    CONSOLIDATE = "consolidate"
    EMBED = "embed"
    REVIEW_MEMORY = "review_memory"
    REVIEW_SKILLS = "review_skills"
