"""Run-level failures. Tool failures are not here: they are results the model reads."""


class EmberError(Exception):
    """Base of every failure Ember reports to a user."""


class ConfigError(EmberError):
    pass


class ModelNotConfigured(ConfigError):
    pass


class ModelError(EmberError):
    """The model endpoint failed in a way retries did not fix. Its kinds below tell a
    caller (a router, a fallback) what to do about it."""


class BudgetSpent(EmberError):
    """A person's daily model budget has no room for this call: the text says whose, how much, and when it renews."""


class ModelUnavailable(ModelError):
    """The endpoint could not be reached, timed out or answered 5xx: another model may answer."""


class ModelTimedOut(ModelUnavailable):
    """No answer within the timeout: each try costs the whole timeout, so one is enough to skip it a while."""


class ModelRateLimited(ModelUnavailable):
    """429: the endpoint asks to wait `retry_after_s` (None: it did not say)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ContextTooLong(ModelError):
    """The request exceeds the model's context window: only a model with a larger one can take it."""


class ModelRefused(ModelError):
    """The provider refused the request or its answer (content policy)."""


class ModelBadRequest(ModelError):
    """The endpoint rejected the request as malformed (our fault): retrying or falling over will not help."""


class StreamBroken(ModelError):
    """The stream broke after it had started: what was sent cannot be taken back, so nothing retries it."""


class StoreConflict(EmberError):
    """A write raced with another writer of the same session."""


class StoreError(EmberError):
    """The store cannot be used as it is (for example, a newer schema)."""


class StoreBusy(StoreError):
    """Another writer held the store past the busy timeout: nothing of the write was kept; try again."""

    def __init__(self, message: str = "Ember's database stayed busy (another process held it too long). "
                                      "Send the message again.") -> None:
        super().__init__(message)


class StoreUnavailable(StoreError):
    """The store could not be opened, read or written (a disk error, a full disk, a lost connection)."""


class LeaseLost(StoreError):
    """This process no longer holds the lease its write was made under (it paused or lost the
    database past the lease's time, and another process took it): nothing of the write was kept."""


class DuplicateMessage(StoreError):
    """The (channel, message_id) was already accepted: nothing was written."""


class MemoryInputError(EmberError):
    """Memory content, a query or an id a person must correct; the message says how."""


class MemoryNotFound(MemoryInputError):
    """No memory of this identity has the id (another identity's memory does not exist for it)."""


class SkillError(EmberError):
    """A skill that cannot be read or admitted as written, or a decision that cannot be taken;
    the message says what to change."""


class SkillNotFound(SkillError):
    pass


class BusUnavailable(EmberError):
    """The message bus (Redis) could not be reached within its retry budget. What was being
    published may or may not have arrived: the bus is at-least-once, so send it again."""
