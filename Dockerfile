# One image for gateway and sim workers (docker-compose.yml). vLLM workers have their
# own: Dockerfile.cpu, Dockerfile.gpu (vLLM's image) and Dockerfile.trtllm; see README.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY sluice ./sluice
COPY gateway ./gateway
COPY engine_worker ./engine_worker
RUN pip install --no-cache-dir .
ENTRYPOINT ["sluice"]
CMD ["up"]
