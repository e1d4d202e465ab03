# The slotctl operator image (`slotctl operator`, see charts/slotctl and docs/kubernetes.md).
#   docker build -t slotctl:0.1.0 .
# The process runtime starts model servers inside this container (install llama-server or
# vLLM in a derived image); with --runtime docker it starts them through the node's engine.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    SLOTCTL_STATE_DIR=/var/lib/slotctl SLOTCTL_CONFIG_DIR=/var/lib/slotctl/config

WORKDIR /src
COPY pyproject.toml README.md ./
COPY controller ./controller
RUN pip install --no-cache-dir . && rm -rf /src

RUN useradd --system --uid 10001 --home-dir /var/lib/slotctl slotctl \
    && mkdir -p /var/lib/slotctl && chown slotctl /var/lib/slotctl
USER 10001
WORKDIR /var/lib/slotctl
EXPOSE 8080 8800
ENTRYPOINT ["slotctl"]
CMD ["operator", "--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz"]
