"""Run-level failures. Tool failures are not here: they are results the model reads."""


class EmberError(Exception):
    """Base of every failure Ember reports to a user."""


class ConfigError(EmberError):
    pass


class ModelNotConfigured(ConfigError):
    pass


class ModelError(EmberError):
    """The model endpoint failed in a way retries did not fix."""


class StoreConflict(EmberError):
    """A write raced with another writer of the same session."""


class StoreError(EmberError):
    """The store cannot be used as it is (for example, a newer schema)."""


class DuplicateMessage(StoreError):
    """The (channel, message_id) was already accepted: nothing was written."""


class MemoryInputError(EmberError):
    """Memory content, a query or an id a person must correct; the message says how."""


class MemoryNotFound(MemoryInputError):
    """No memory of this identity has the id (another identity's memory does not exist for it)."""
