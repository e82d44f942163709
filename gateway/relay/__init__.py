"""The relay: the hop to workers (NDJSON, or an engine server directly) and back to the client
as SSE events or one JSON body."""
