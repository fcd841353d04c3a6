"""One reader of a measured pass: ``python -m fanstore.select.epochreader CMD_FD RES_FD``.

Started by :func:`fanstore.select.epoch.run_pass` (fork-and-exec: the selection that runs a
pass may have threads). It reads its job from its command pipe (a JSON frame: the target,
the list, its slot and step, its share of the warm-up), opens what it reads through, reads
its share of the warm-up, says it is ready and waits for the start; then it reads files
``slot, slot+step, ...`` of the list and answers with its result (a JSON frame). The
frame kinds are :mod:`fanstore.select.epoch`'s (which never imports this module:
``python -m`` runs it).
"""

from __future__ import annotations

import gc
import json
import os
import sys

from fanstore.process import become_worker, read_frame, write_frame
from fanstore.select import epoch
from fanstore.select.epoch import FAILED, GO, JOB, READY, READ_BYTES, RESULT

def main(argv: list[str]) -> int:
    become_worker()
    cmd, res = int(argv[0]), int(argv[1])
    got = read_frame(cmd)
    if got is None or got[0] != JOB:
        return 1
    job = json.loads(got[1])
    gc.disable()  # no collection pauses inside the timed pass
    try:
        store = epoch.open_target(job)
        buf = bytearray(READ_BYTES)
        for rel in job["warmup"]:
            if store is None:
                epoch.read_mount(os.path.join(job["root"], rel), buf)
            else:
                store.read(rel)
    except Exception as exc:  # noqa: BLE001 - reported by the pass
        write_frame(res, FAILED, f"{type(exc).__name__}: {exc}".encode("utf-8", "replace"))
        return 1
    write_frame(res, READY)
    got = read_frame(cmd)
    if got is None or got[0] != GO:
        return 1  # the pass was abandoned
    result = epoch.read_share(job, store, buf)
    write_frame(res, RESULT, json.dumps(result).encode())
    if store is not None:
        store.close()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (BrokenPipeError, KeyboardInterrupt):
        os._exit(1)
