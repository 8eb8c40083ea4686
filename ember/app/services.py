"""The services a command builds on an open store without the rest of the runtime: the skills
and the memory. runtime.py wires the same ones; a CLI command that lists skills need not import
the models, channels and pipeline (most of a second of start-up)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ember.config.settings import Settings
from ember.skills.folders import default_folders
from ember.skills.library import SkillLibrary, SkillPolicy
from ember.store.engine import Database
from ember.store.skills import SqlSkillStore

if TYPE_CHECKING:
    from ember.memory.embeddings import Embedder
    from ember.memory.service import MemoryService


def skill_library(settings: Settings, db: Database) -> SkillLibrary:
    """The skills of `db`, with the bundled folders and the person's."""
    policy = SkillPolicy(settings.skills_auto_admit, settings.skills_index_chars, settings.skills_archive_after_days)
    return SkillLibrary(SqlSkillStore(db), default_folders(settings.skills_path), policy)


def memory_service(settings: Settings, db: Database, embedder: Embedder | None = None) -> MemoryService:
    """The memory of `db` with the configured embedder (loaded here unless given)."""
    # Imported here: numpy and the memory's rows are a quarter of a second a skills command does without.
    from ember.memory.embeddings import load_embedder
    from ember.memory.identity import Identities
    from ember.memory.service import MemoryService
    from ember.store.memories import SqlMemoryStore

    if embedder is None:
        base_url, key = embedding_endpoint(settings)
        embedder = load_embedder(settings.embedding_model, base_url=base_url, api_key=key,
                                 relevance_floor=settings.embedding_relevance_floor)
    return MemoryService(SqlMemoryStore(db, embeds=embedder is not None), embedder,
                         identities=Identities(settings.identities))


def embedding_endpoint(settings: Settings) -> tuple[str | None, str | None]:
    """(base URL, key) of an "openai:MODEL" embedder: its own settings, else the chat model's
    (the single-model settings, else the first OpenAI-compatible one of [models])."""
    base_url, key = settings.model_base_url, settings.model_api_key
    if base_url is None:
        named = next((spec for spec in settings.models.values() if spec.provider == "openai"), None)
        if named is not None:
            base_url, key = named.base_url, named.key()
    own_key = settings.embedding_api_key.get_secret_value() if settings.embedding_api_key is not None else None
    if settings.embedding_base_url is not None:
        return settings.embedding_base_url, own_key
    return base_url, own_key or key
