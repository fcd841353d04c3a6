"""The ``fanstore`` command. Only ``main`` turns errors into messages and exit codes.

Exit codes: 0 ok; 1 failure (including damaged files found by ``verify``); 2 bad usage;
3 no codec meets the budget (``select``); 32/33 store format too old/new; 70 internal
error; 130 interrupted.

The commands live in modules by what they work on: ``pack`` (:mod:`.pack`), live mounts
(:mod:`.mount`: mount, umount, wait, prefetch, stats), a store at rest (:mod:`.store`:
verify, info, ls, cat) and ``select`` (:mod:`.select`); :mod:`.common` has what they share.
Each adds its parsers (``add_parsers``) and sets ``func`` to its command.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from fanstore import settings
from fanstore.cli import mount, pack, select, store
from fanstore.cli.common import Parser, say
from fanstore.errors import FanStoreError, UsageError
from fanstore.version import __version__

log = logging.getLogger("fanstore")


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    common.add_argument("--debug", action="store_true",
                        help="verbose logging and a traceback on errors")
    p = Parser(prog="fanstore", parents=[common],
               description="Compressed burst-buffer object store for deep-learning training.")
    p.add_argument("--version", action="version", version=f"fanstore {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    pack.add_parsers(sub, common)
    mount.add_parsers(sub, common)
    store.add_parsers(sub, common)
    select.add_parsers(sub, common)
    return p


def run() -> int:
    """The ``fanstore`` command's entry point: :func:`main` in FanStore's process
    environment (``process.PROCESS_ENV``, set before anything imports numpy), which the
    command's daemons, ranks and workers inherit."""
    from fanstore.process import PROCESS_ENV

    os.environ.update(PROCESS_ENV)
    return main()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        settings.current()  # the environment, read once: a bad value stops here (status 2)
        args = build_parser().parse_args(argv)
        if not getattr(args, "command", None):
            raise UsageError("no command given (see 'fanstore --help')")
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING,
                                format="fanstore: %(levelname)s: %(message)s")
        return int(args.func(args) or 0)
    except FanStoreError as exc:
        if debug:
            import traceback

            traceback.print_exc()
        if not exc.quiet:
            say(f"{exc.label}: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except BrokenPipeError:
        sys.stdout = None  # type: ignore[assignment]
        return 1
    except OSError as exc:
        if debug:
            import traceback

            traceback.print_exc()
        where = f": {exc.filename}" if exc.filename else ""
        say(f"error: {exc.strerror or exc}{where}")
        return 1
    except Exception as exc:  # noqa: BLE001 - last line of defence: never a raw traceback
        if debug:
            import traceback

            traceback.print_exc()
        say(f"internal error: {type(exc).__name__}: {exc} (run with --debug for "
            "details)")
        return 70

