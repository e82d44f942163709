# One image for gateway and sim workers. The vLLM CPU worker needs the `cpu`
# extra and the model (see README); GPU images build on a CUDA base instead.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY sluice ./sluice
COPY gateway ./gateway
COPY engine_worker ./engine_worker
RUN pip install --no-cache-dir .
ENTRYPOINT ["sluice"]
CMD ["up"]
