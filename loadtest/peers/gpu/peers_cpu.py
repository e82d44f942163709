"""usage: peers_cpu.py snap NAME=PID...  |  peers_cpu.py diff LOADLINE SNAP0 SNAP1 > merged line

snap: CPU seconds (user + system) of each named process and everything under it (children
in their own sessions too: `sluice gateway --procs N` starts them so), per pid, as JSON.
diff: adds to the load generator's JSON line, per name, the CPU seconds spent between the two
snapshots, cores busy on average (cpu_s / wall_s), the busiest single process's cores, and
microseconds per streamed chunk.
"""
import json
import os
import sys

sys.path.insert(0, os.getcwd())  # the kit runs it from the repository's root
from loadtest.peers import proc_cpu


def snap(pairs):
    table = proc_cpu.process_table()
    res = {}
    for pair in pairs:
        name, root = pair.split("=")
        if not root or int(root) not in table:
            continue
        res[name] = {str(pid): table[pid][2] for pid in proc_cpu.tree({int(root)}, table)}
    return res


def diff(line, s0, s1):
    d = json.loads(line)
    wall = d.get("wall_s") or 0
    cpu = {}
    for name, tree in s1.items():
        per = [t - s0.get(name, {}).get(pid, t) for pid, t in tree.items()]
        tot = sum(per)
        cpu[name] = {"cpu_s": round(tot, 2), "cores": round(tot / wall, 2) if wall else None,
                     "max_proc_cores": round(max(per) / wall, 2) if wall and per else None,
                     "procs": len(per),
                     "us_per_chunk": round(tot / (d["chunks_per_s"] * wall) * 1e6, 1) if d.get("chunks_per_s") and wall else None}
    d["cpu"] = cpu
    return d


if __name__ == "__main__":
    if sys.argv[1] == "snap":
        print(json.dumps(snap(sys.argv[2:])))
    else:
        print(json.dumps(diff(sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]))))
