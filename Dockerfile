# One image for the gateway and sim workers (docker-compose.yml). vLLM workers have
# their own: Dockerfile.cpu, Dockerfile.gpu (vLLM's image) and Dockerfile.trtllm.
# Built and run by tests/test_compose.py on local stand-ins for python:3.11-slim.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
# Not root: nothing in Sluice needs it (ports above 1024, no writes outside $HOME).
# Written by hand rather than with useradd, which minimal Debian bases lack.
RUN echo "sluice:x:10001:10001:sluice:/home/sluice:/usr/sbin/nologin" >> /etc/passwd \
    && echo "sluice:x:10001:" >> /etc/group \
    && mkdir -p /home/sluice && chown 10001:10001 /home/sluice
WORKDIR /app

# Dependencies first, read from pyproject.toml alone, so that a change to the code
# rebuilds (and ships) only the small layer below, not the ~100 MB of dependencies.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY README.md ./
COPY sluice ./sluice
COPY gateway ./gateway
COPY engine_worker ./engine_worker
RUN pip install --no-deps . && rm -rf build *.egg-info

USER 10001
# PID 1 is sluice itself: SIGTERM reaches it directly and drains (a worker finishes its
# streams within SLUICE_WORKER_DRAIN_TIMEOUT_S, a gateway within
# SLUICE_GATEWAY_SHUTDOWN_GRACE_S); the orchestrator's grace period must exceed both.
STOPSIGNAL SIGTERM
ENTRYPOINT ["sluice"]
CMD ["up"]
