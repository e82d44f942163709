"""The nemesis: random faults of every kind under load, every stream checked against its exact reference.

Jepsen's shape: clients record a history of what they saw, a nemesis injects faults
from a seeded schedule, and a checker classifies every request afterwards against a
model of what was allowed (DESIGN.md §2).

    workload.py   the requests of a run, from the seed, and each one's exact reference
    schedule.py   the faults of a run, from the seed
    topology.py   the Redis under test (one server; Sentinel; Cluster) and what can be done to it
    proxy.py      a TCP proxy between one gateway and Redis, to delay or cut that link
    system.py     Redis, sim workers and gateway processes, each restartable on its own port
    faults.py     runs the schedule against the system; records when each fault really ran
    clients.py    plain, resumable and non-streaming clients; each records its history
    history.py    what a client saw (the recorder's data)
    checker.py    exact / explicit error / forbidden, per request
    invariants.py what must hold once the load and the faults are over
    report.py     the table, the JSON summary and the PNG timeline
    run.py        one run, end to end

>>> result = run_nemesis(NemesisConfig(seed=7, streams=320, faults=32, duration_s=120))
>>> result.forbidden  # [] when nothing forbidden happened
"""
