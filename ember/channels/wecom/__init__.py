"""WeCom (企业微信) self-built apps and smart bots, and WeChat Official Accounts (微信公众号): the callback
crypto, and the `wecom`, `wecom_bot` and `wechat` channels."""
