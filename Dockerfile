# Ember from this repository, for compose.yaml (or any container runtime).
#   docker build -t ember .
# The same image runs a gateway (`ember serve --workers 0 --host 0.0.0.0`) or a worker
# (`ember worker`); compose.yaml says which. Python 3.12 satisfies pyproject's requires-python.
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Only what the package is built from (.dockerignore keeps .venv, tests and bench out of the context).
COPY pyproject.toml ./
COPY ember ./ember
RUN pip install . \
    && useradd --system --home-dir /var/lib/ember --shell /usr/sbin/nologin ember \
    && mkdir -p /var/lib/ember/workspace /var/lib/ember/workspaces \
    && chown -R ember:ember /var/lib/ember

# Not root. EMBER_HOME holds ember.log, locks/, skills/, a2a.db, workspace/ and workspaces/; the store
# itself is in PostgreSQL when EMBER_DATABASE_URL is set. The workspace directories exist in the image so
# that a volume mounted on one starts out owned by `ember`.
USER ember
ENV EMBER_HOME=/var/lib/ember
WORKDIR /var/lib/ember

EXPOSE 8765
# Listening beyond loopback needs EMBER_API_KEYS: without keys this exits 2 and says so.
CMD ["ember", "serve", "--host", "0.0.0.0"]
