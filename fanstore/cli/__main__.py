"""``python -m fanstore.cli``: the ``fanstore`` command."""

import sys

from fanstore.cli import run

if __name__ == "__main__":
    sys.exit(run())
