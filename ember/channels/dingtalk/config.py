"""`[dingtalk]` in ember.toml: the DingTalk (钉钉) app robot, who may talk to it, and where its APIs are."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

SECRET_ENV = "EMBER_DINGTALK_APP_SECRET"


class DingTalkSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The app's AppKey (Client ID), from the DingTalk developer console.
    app_key: str = Field(min_length=1)
    # Its AppSecret (Client Secret), which also signs the callbacks; or EMBER_DINGTALK_APP_SECRET.
    app_secret: SecretStr | None = None
    # The robot's code (robotCode); by default the AppKey, as for an app's own robot.
    robot_code: str | None = None
    # Where the OpenAPI is (the tests' own, or a proxy).
    api_base_url: str = "https://api.dingtalk.com"
    # Where the older API that takes file uploads (media/upload) is.
    oapi_base_url: str = "https://oapi.dingtalk.com"
    # "http": DingTalk calls back at gateway_public_url/channels/dingtalk/events; "stream": Ember opens
    # a WebSocket to DingTalk (Stream mode: no public URL needed).
    mode: Literal["http", "stream"] = "http"
    # Staff ids (senderStaffId) that may talk to the agent; empty: every member of the organisation.
    allowed_users: list[str] = Field(default_factory=list)
    # Staff ids that may answer anyone's approval requests (besides the person whose turn asks).
    approvers: list[str] = Field(default_factory=list)

    def key(self) -> str | None:
        return self.app_secret.get_secret_value() if self.app_secret else os.environ.get(SECRET_ENV) or None

    @property
    def robot(self) -> str:
        return self.robot_code or self.app_key
