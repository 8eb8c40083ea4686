"""A throwaway IMAP server for tests: Debian's Dovecot on a free loopback port, with one mailbox
user (`USER`, `PASSWORD`) whose mail lives in a temporary folder, as `imap_server`. Tests put mail
in with IMAP APPEND (`deliver`), as a mail server's delivery would, and read flags back over IMAP.
Without `dovecot` the fixture fails and says how to get it (`make test` installs it)."""

from __future__ import annotations

import imaplib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from email.message import EmailMessage
from pathlib import Path

import pytest

from tests.reaper import die_with_parent

HOST = "127.0.0.1"
USER, PASSWORD = "ember@example.test", "imap-test-password"
START_TIMEOUT_S = 15.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _mail_owner() -> pwd.struct_passwd:
    """Whose the mail files are: Dovecot never keeps mail as root, so as root, nobody's."""
    return pwd.getpwuid(os.getuid()) if os.getuid() != 0 else pwd.getpwnam("nobody")


def _config(folder: Path, port: int, owner: pwd.struct_passwd) -> str:
    return f"""
protocols = imap
listen = {HOST}
base_dir = {folder}/run
state_dir = {folder}/state
log_path = {folder}/dovecot.log
ssl = no
disable_plaintext_auth = no
auth_mechanisms = plain login
mail_location = maildir:{folder}/mail/%u
mail_uid = {owner.pw_uid}
mail_gid = {owner.pw_gid}
passdb {{
  driver = passwd-file
  args = scheme=PLAIN username_format=%u {folder}/users
}}
userdb {{
  driver = static
  args = uid={owner.pw_uid} gid={owner.pw_gid} home={folder}/home/%u
}}
service imap-login {{
  inet_listener imap {{
    address = {HOST}
    port = {port}
  }}
  inet_listener imaps {{
    port = 0
  }}
}}
service anvil {{
  chroot =
}}
service imap-login {{
  chroot =
}}
"""


class ImapServer:
    def __init__(self, executable: str, folder: Path, *, settings: str = "") -> None:
        self.folder = folder
        folder.chmod(0o755)  # Dovecot's auth process, as its own user, reads the users file here
        self.port = _free_port()
        (folder / "users").write_text(f"{USER}:{{PLAIN}}{PASSWORD}\n")
        owner = _mail_owner()
        for kept in ("mail", "home"):
            (folder / kept).mkdir()
            os.chown(folder / kept, owner.pw_uid, owner.pw_gid)
        (folder / "dovecot.conf").write_text(_config(folder, self.port, owner) + settings)
        self._process = subprocess.Popen(
            [executable, "-F", "-c", str(folder / "dovecot.conf")],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._greets():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                log = folder / "dovecot.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
                pytest.fail(f"the test Dovecot did not start on port {self.port}:\n{tail}")
            time.sleep(0.05)

    def _greets(self) -> bool:
        try:
            with socket.create_connection((HOST, self.port), timeout=0.5) as sock:
                return sock.recv(64).startswith(b"* OK")
        except OSError:
            return False

    def client(self) -> imaplib.IMAP4:
        imap = imaplib.IMAP4(HOST, self.port, timeout=10)
        imap.login(USER, PASSWORD)
        return imap

    def deliver(self, message: EmailMessage) -> None:
        """Put a mail in the inbox, unread, as delivery would."""
        with self.client() as imap:
            imap.append("INBOX", "", imaplib.Time2Internaldate(time.time()), message.as_bytes())

    def unseen(self) -> int:
        """How many mails of the inbox are not marked read."""
        with self.client() as imap:
            imap.select("INBOX")
            _, found = imap.search(None, "UNSEEN")
            return len(found[0].split())

    def clear(self) -> None:
        with self.client() as imap:
            _, exists = imap.select("INBOX")
            if int(exists[0] or 0):
                imap.store("1:*", "+FLAGS", "\\Deleted")
                imap.expunge()

    def stop(self) -> None:
        """Stop the server by its PID, and wait for it."""
        self._process.terminate()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


@contextmanager
def dovecot(settings: str = "") -> Iterator[ImapServer]:
    """A Dovecot of its own, with `settings` added to its configuration."""
    executable = shutil.which("dovecot") or ("/usr/sbin/dovecot" if Path("/usr/sbin/dovecot").exists() else None)
    if executable is None:
        pytest.fail("the email tests need Debian's Dovecot: apt-get install dovecot-imapd (make test does)")
    folder = Path(tempfile.mkdtemp(prefix="ember-imap-"))
    server = ImapServer(executable, folder, settings=settings)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def imap_server() -> Iterator[ImapServer]:
    with dovecot() as server:
        yield server
