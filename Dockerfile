# Router, cachestore and operator image (torch-free): `ragserve router|cachestore|operator ...`.
#   docker build -t ragserve:latest .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ragserve ragserve
COPY router router
COPY cachestore cachestore
COPY operator operator
RUN python -m venv /opt/ragserve \
    && /opt/ragserve/bin/pip install --no-cache-dir ./ ./router ./cachestore ./operator \
    && /opt/ragserve/bin/python -c "import ragserve_router.server, ragserve_cachestore.server, ragserve_operator.cli, sys; assert 'torch' not in sys.modules"

FROM python:3.11-slim
RUN useradd --system --uid 10001 --create-home --shell /usr/sbin/nologin ragserve \
    && mkdir -p /var/cache/ragserve && chown ragserve:ragserve /var/cache/ragserve
COPY --from=build /opt/ragserve /opt/ragserve
ENV PATH=/opt/ragserve/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
USER 10001
WORKDIR /home/ragserve
EXPOSE 8080 50051 50061 9090
# the router's liveness; the cachestore service overrides it with a gRPC health check
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD python -m ragserve.stack.health "http://127.0.0.1:${RAGSERVE_PORT:-8080}/health"
CMD ["ragserve", "router", "--host", "0.0.0.0", "--port", "8080", "--grpc-port", "50051"]
