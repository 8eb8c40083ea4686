"""Webhooks: signed requests in (`POST /webhooks/{name}`) and signed answers out (`[outbound.*]`)."""
