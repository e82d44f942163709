"""The engine worker: one inference engine behind a streaming NDJSON endpoint."""
