"""Fault injection for the pack's worker processes (tests only): put this directory first
on PYTHONPATH and set ``FANSTORE_TEST_WORKER_FAULT`` to

- ``stall``: a worker reports one byte of progress, then sleeps (a test can then kill it
  while it holds a partition, however fast or busy the machine);
- ``segv``: a worker crashes (a read of address 0) as it starts a partition;
- ``digest-stall``: as ``stall``, in the duplicate search;
- ``reader-dies`` / ``reader-hangs``: a reader of a measured pass (``fanstore select``)
  whose target root matches the regular expression ``$FANSTORE_TEST_FAULT_WHERE`` exits
  with status 9 (what the OOM killer's victim shows as a pid gone) or sleeps, once it has
  been told to start reading.
- ``dedup-rewrite`` / ``dedup-append``: in the pack's own process, right after the
  duplicate search compared a file's bytes with its first copy's and found them equal, a
  duplicate whose path matches ``$FANSTORE_TEST_FAULT_WHERE`` is changed: rewritten with
  other bytes of the same size, its modification time moved one second on (what a write
  a second later does; set, so the test does not depend on the clock's tick), or one byte
  appended with its modification time kept as it was (only its size tells).

For the start of a mount (tests/test_start_faults.py), ``FANSTORE_TEST_START_HOLD`` is
``WHERE:RANK``: the process of MPI rank RANK (``PMI_RANK``; ``any``: every process) stops
for good at WHERE, as a hung process would: ``before-mpi-init``, ``after-mpi-init`` (in
``fanstore.daemon.world._init_mpi``), ``hello`` (a worker rank's hello,
``fanstore.daemon.nodegroup.WorkerSide.hello``), ``join`` (a worker rank joining the
kernel frontend, ``fanstore.fuse.kernelfs.process.serve_worker``) or ``stage``
(``fanstore.daemon.staging.stage_partitions``). With ``FANSTORE_TEST_FAULT_MARK`` set, every rank creates
``MARK.mpi-init.RANK`` as it enters MPI_Init and the held one ``MARK.held.RANK``.

A stalled worker first creates the file ``$FANSTORE_TEST_FAULT_MARK.<its pid>`` (when that
variable is set): the test knows which worker holds a task. Every process started with it
imports this module; only worker processes call what it
replaces (``fanstore.pack.worker.pack_partition``, ``fanstore.pack.dedup.digest_all``), so
the pack's own process runs unchanged, but for the ``dedup-*`` faults
(``fanstore.pack.dedup._equal_in``). A site's own sitecustomize, if any, is not run.
"""

import importlib.abc
import importlib.util
import os
import sys

_FAULT = os.environ.get("FANSTORE_TEST_WORKER_FAULT", "")
_HOLD_WHERE, _, _HOLD_RANK = os.environ.get("FANSTORE_TEST_START_HOLD", "").partition(":")
_HOLD_AT = {"fanstore.daemon.world": "_init_mpi", "fanstore.daemon.staging": "stage_partitions",
            "fanstore.daemon.nodegroup": "WorkerSide",
            "fanstore.fuse.kernelfs.process": "serve_worker"}
_TARGETS = {("fanstore.pack.worker", "stall"): "pack_partition",
            ("fanstore.pack.worker", "segv"): "pack_partition",
            ("fanstore.pack.dedup", "digest-stall"): "digest_all",
            ("fanstore.pack.dedup", "dedup-rewrite"): "_equal_in",
            ("fanstore.pack.dedup", "dedup-append"): "_equal_in",
            ("fanstore.select.epoch", "reader-dies"): "read_share",
            ("fanstore.select.epoch", "reader-hangs"): "read_share"}


def _fault(progress=None):
    if _FAULT == "segv":
        import ctypes

        ctypes.string_at(0)
    if progress is not None:
        progress(1)
    mark = os.environ.get("FANSTORE_TEST_FAULT_MARK")
    if mark:
        with open(f"{mark}.{os.getpid()}", "w"):
            pass
    import time

    time.sleep(3600)


def _reader_fault(real, job, *rest):
    import re
    import time

    if not re.search(os.environ.get("FANSTORE_TEST_FAULT_WHERE", "^$"), job["root"]):
        return real(job, *rest)
    if _FAULT == "reader-dies":
        os._exit(9)
    time.sleep(120)  # the pass's time limit ends it


def _mark(what):
    mark = os.environ.get("FANSTORE_TEST_FAULT_MARK")
    if mark:
        with open(f"{mark}.{what}.{os.environ.get('PMI_RANK', '0')}", "w"):
            pass


def _held(where):
    """Stop here for good when this is the held process and place."""
    import time

    if where == _HOLD_WHERE and _HOLD_RANK in ("any", os.environ.get("PMI_RANK", "0")):
        _mark("held")
        while True:
            time.sleep(3600)


def _hold_start(module):
    if module.__name__ == "fanstore.daemon.world":
        real = module._init_mpi

        def init_mpi(*args, **kw):
            _held("before-mpi-init")
            _mark("mpi-init")
            out = real(*args, **kw)
            _held("after-mpi-init")
            return out

        module._init_mpi = init_mpi
    elif module.__name__ == "fanstore.fuse.kernelfs.process":
        _hold_before(module, "serve_worker", "join")
    elif module.__name__ == "fanstore.daemon.staging":
        _hold_before(module, "stage_partitions", "stage")
    else:
        _hold_before(module.WorkerSide, "hello", "hello")


def _hold_before(owner, attr, where):
    """``owner.attr`` holds the process at ``where`` before it runs."""
    real = getattr(owner, attr)

    def held(*args, **kw):
        _held(where)
        return real(*args, **kw)

    setattr(owner, attr, held)


class _HoldHook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _HOLD_AT:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _hold_start(module)

        spec.loader.exec_module = exec_module
        return spec


def _change_duplicates(real, group, paths):
    import re

    found = real(group, paths)
    for dup in found:
        path = paths[dup]
        if not re.search(os.environ.get("FANSTORE_TEST_FAULT_WHERE", "^$"),
                         os.fsdecode(path)):
            continue
        st = os.stat(path)
        if _FAULT == "dedup-append":
            with open(path, "ab") as f:
                f.write(b"!")
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        else:
            with open(path, "r+b") as f:
                data = f.read()
                f.seek(0)
                f.write(bytes(b ^ 0xFF for b in data))
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    return found


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if (name, _FAULT) not in _TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        attr = _TARGETS[name, _FAULT]
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            real = getattr(module, attr)

            def faulty(first, second=None, *rest):
                if attr == "read_share":
                    return _reader_fault(real, first, second, *rest)
                if attr == "_equal_in":
                    return _change_duplicates(real, first, second)
                _fault(second if attr == "pack_partition" else None)

            setattr(module, attr, faulty)

        spec.loader.exec_module = exec_module
        return spec


if _FAULT:
    sys.meta_path.insert(0, _Hook())
if _HOLD_WHERE:
    sys.meta_path.insert(0, _HoldHook())
