# gapless on the cpu device. The install steps are the Makefile's `setup` and `model` targets
# (tests/test_docker.py keeps them the same). Build: docker build -t gapless .
# Run: docker run -p 127.0.0.1:8000:8000 gapless [serve flags]
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GAPLESS_CACHE_DIR=/opt/gapless/models \
    PATH=/opt/gapless/.venv/bin:$PATH
WORKDIR /opt/gapless

COPY pyproject.toml README.md Makefile constraints.txt ./
COPY common common
COPY launch launch
COPY core core
COPY frontend frontend
COPY detokenizer detokenizer
COPY gpu_runner gpu_runner
COPY shm shm
COPY bench bench

# hadolint ignore=DL3013
RUN python3 -m venv .venv \
    && .venv/bin/python -m pip install --no-cache-dir --quiet --upgrade pip \
    && .venv/bin/python -m pip install --no-cache-dir --quiet torch==2.13.0 \
    && .venv/bin/python -m pip install --no-cache-dir --quiet -c constraints.txt -e '.[test,bench]' \
    && .venv/bin/python -m gapless.common.model_cache

RUN useradd --system --uid 10001 --home-dir /opt/gapless gapless && chown -R 10001 /opt/gapless
USER 10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"]
# why 0.0.0.0: the container has its own network; publish the port on 127.0.0.1 (above)
ENTRYPOINT ["gapless", "serve", "--host", "0.0.0.0"]
