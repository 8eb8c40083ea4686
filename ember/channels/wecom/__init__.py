"""WeCom (企业微信) and WeChat Official Account callbacks: signatures and the AES message envelope."""
