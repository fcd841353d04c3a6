"""The FUSE front end (pyfuse3 + trio): a thin ``Operations`` class and the mount wiring."""
