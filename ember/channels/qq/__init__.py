"""QQ official bot (QQ 机器人): the webhook's Ed25519 signatures and callback-URL validation."""
