"""Compare two py-spy raw profiles (``py-spy record -f raw``) frame by frame.

    python benchmarks/spy-diff.py spy-pipelined.txt spy-sequential.txt [--top 40] [--by python]

Prints each frame's inclusive share of its profile's samples in both, the frames whose
shares differ most first: where one engine mode spends host time the other does not.
Frames are named without their source line, and bare addresses are dropped (they differ
between processes). ``--by python`` instead gives each sample to its deepest Python frame
(with its line), marked ``native <-`` when native code ran below it (MLX's encoding, when
profiled with ``--native``): how the Python threads' time splits between Python and native code.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

LOCATION = re.compile(r" \(.*\)$")
PYTHON_FRAME = re.compile(r"\.py:\d+\)$")


def inclusive_shares(path: Path) -> dict[str, float]:
    """Each frame's share of the samples whose stack holds it (once per stack)."""
    samples: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = {LOCATION.sub("", f) for f in stack.split(";") if not f.startswith("0x")}
        for frame in frames:
            samples[frame] += n
    return {frame: n / total for frame, n in samples.items()} if total else {}


def python_frame_shares(path: Path) -> dict[str, float]:
    """Each deepest Python frame's share of the samples that have one (native code below it marked)."""
    samples: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        python = [i for i, f in enumerate(frames) if PYTHON_FRAME.search(f)]
        if python:  # threads with no Python frame (MLX's own) are left out
            below = frames[python[-1] + 1:]
            samples[("native <- " if below else "") + frames[python[-1]]] += int(count)
    total = sum(samples.values())
    shares = {frame: n / total for frame, n in samples.items()} if total else {}
    native = sum(v for f, v in shares.items() if f.startswith("native <- "))
    return {"(all native)": native, "(all Python)": 1 - native if shares else 0, **shares}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--by", choices=["frame", "python"], default="frame")
    args = parser.parse_args()
    shares = inclusive_shares if args.by == "frame" else python_frame_shares
    a, b = shares(args.first), shares(args.second)
    frames = sorted(set(a) | set(b), key=lambda f: -abs(a.get(f, 0) - b.get(f, 0)))
    print(f"{args.first.name:>10.10} {args.second.name:>10.10}  frame")
    for frame in frames[: args.top]:
        print(f"{100 * a.get(frame, 0):9.1f}% {100 * b.get(frame, 0):9.1f}%  {frame[:140]}")


if __name__ == "__main__":
    main()
