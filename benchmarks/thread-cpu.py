"""Each thread's CPU share of a running process over a few seconds, and the cores it ran on.

    python benchmarks/thread-cpu.py PID [SECONDS]

For the question a sampling profiler cannot answer: py-spy sees only Python's threads, and the
engine's host time per round grows when the GPU is busy in every frame alike, as if the thread
ran slower; a native thread of MLX's (an event poller, a completion handler) spinning on the
same physical core would do that. Reads /proc (Linux), prints one line per thread and the
cores' hyper-thread siblings.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def thread_times(pid: int) -> dict[int, tuple[str, int, int]]:
    """tid -> (name, user + system clock ticks, the core it last ran on)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended between listing and reading
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()  # fields from the state on (stat's 3rd field)
        out[int(task.name)] = (name, int(fields[11]) + int(fields[12]), int(fields[36]))
    return out


def siblings() -> list[str]:
    """Each physical core's logical CPUs, such as "0,8" or "0-1"."""
    paths = Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology/thread_siblings_list")
    return sorted({path.read_text().strip() for path in paths})


def main(argv: list[str]) -> None:
    pid, seconds = int(argv[1]), float(argv[2]) if len(argv) > 2 else 5.0
    ticks = os.sysconf("SC_CLK_TCK")
    before = thread_times(pid)
    time.sleep(seconds)
    after = thread_times(pid)
    rows = []
    for tid, (name, total, core) in after.items():
        used = (total - before.get(tid, (name, 0, core))[1]) / ticks / seconds  # one born in the window: all its time
        rows.append((used, tid, name, core))
    for used, tid, name, core in sorted(rows, reverse=True):
        if used >= 0.005:
            print(f"thread {tid:>8} {name:<16} {used:6.1%} of a core, last on cpu {core}")
    print("hyper-thread siblings:", " ".join(siblings()))


if __name__ == "__main__":
    main(sys.argv)
