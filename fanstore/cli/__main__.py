"""``python -m fanstore.cli``: the ``fanstore`` command."""

import sys

from fanstore.cli import main

if __name__ == "__main__":
    sys.exit(main())
