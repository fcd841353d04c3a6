#!/usr/bin/env python3
"""User command of the Slurm end-to-end test: runs on each node inside slurm/train.sbatch.

    slurm_reader.py MOUNT SRC OUTDIR

Reads every file of SRC through MOUNT, compares the bytes, then records this node's
`fanstore stats --json` and the counts in OUTDIR/<node>.json. Exits 0 only if every file
matched and some files came from the other node (remote reads).
"""

import json
import os
import subprocess
import sys


def main() -> int:
    mount, src, outdir = sys.argv[1:4]
    node = os.environ.get("SLURMD_NODENAME", "node")
    assert os.environ.get("FANSTORE_MOUNT") == mount, (os.environ.get("FANSTORE_MOUNT"), mount)
    ok, wrong = 0, []
    for dirpath, _dirs, files in os.walk(src):
        for name in files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, src)
            with open(path, "rb") as a, open(os.path.join(mount, rel), "rb") as b:
                if a.read() == b.read():
                    ok += 1
                else:
                    wrong.append(rel)
    fanstore = os.environ.get("FANSTORE", "fanstore")
    stats = json.loads(subprocess.run([fanstore, "stats", mount, "--json"], check=True,
                                      capture_output=True, text=True).stdout)
    with open(os.path.join(outdir, f"{node}.json"), "w") as f:
        json.dump({"node": node, "ok": ok, "wrong": wrong, "stats": stats}, f)
    return 0 if not wrong and ok and stats["remote_reads"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
