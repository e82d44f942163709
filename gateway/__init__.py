"""The Sluice gateway: OpenAI-compatible HTTP in, admission through Redis, NDJSON to workers."""
