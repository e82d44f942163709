"""Admission: who may call (tenancy, caps), then one shared priority queue per model in Redis
that grants worker slots (Lua scripts, grant delivery, cache routing, the lease reaper)."""
