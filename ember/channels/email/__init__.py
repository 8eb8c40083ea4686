"""The email channel: IMAP in, SMTP out, one session per thread."""
