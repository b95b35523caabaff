# triage-proxy: docker build -t triage-proxy . && docker run -p 8080:8080 triage-proxy
# Mount your own routing table over /etc/triage-proxy/routing.yaml.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PYTHONMALLOC=malloc

WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY proxy ./proxy
RUN pip install . && useradd --system --uid 10001 --no-create-home proxy

COPY routing.yaml /etc/triage-proxy/routing.yaml
USER proxy
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status != 200)"
ENTRYPOINT ["triage-proxy", "serve", "--config", "/etc/triage-proxy/routing.yaml", "--host", "0.0.0.0", "--port", "8080"]
