"""FanStore's pyfuse3 frontend: one process, libfuse and trio (``--frontend pyfuse3``).

- :mod:`.operations`: the ``pyfuse3.Operations`` adapter over :mod:`fanstore.fuse.fsops`;
- :mod:`.reader`: ``AsyncReader``, the read core's calls moved off the trio loop;
- :mod:`.frontend`: the mount's lifetime (``pyfuse3.init``/``main``/``close``).
"""
