"""QQ official bot (QQ 机器人): the webhook channel, its Ed25519 signatures, and the OpenAPI it replies through."""
