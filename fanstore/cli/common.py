"""What every command shares: the argument parser class, argument types, the argument
groups several commands take, object-storage set-up, and the one way to tell the user
something on stderr."""

from __future__ import annotations

import argparse
import math
import sys

from fanstore.errors import UsageError
from fanstore.settings import current


def say(text: str) -> None:
    """One line for the user on stderr: ``fanstore: TEXT``, in one write: the ranks of a
    job often share one log, and a line written in two pieces (the text, then the newline)
    interleaves with another rank's."""
    try:
        sys.stderr.write(f"fanstore: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


def ranks_per_node(text: str):
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected auto or a positive integer, got {text!r}")
    return value


def number(kind, minimum, strict: bool):
    """An argparse type: ``kind`` (int or float) at least (or above) ``minimum``."""
    what = "a whole number" if kind is int else "a number"
    if strict:
        bound = f"be more than {minimum}" if minimum else "be positive"
    else:
        bound = f"be at least {minimum}" if minimum else "not be negative"

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum or (strict and value == minimum) or math.isnan(value):
            raise argparse.ArgumentTypeError(f"must {bound}, got {text}")
        return value

    return convert


positive_int = number(int, 1, strict=False)
nonneg_int = number(int, 0, strict=False)
positive_float = number(float, 0.0, strict=True)


def size(text: str) -> int:
    """An argparse type: a size in bytes (500G, 1.5T, 800M, 123456: fanstore.units)."""
    from fanstore.units import parse_size

    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {text!r}")
    return value


def replicas(text: str) -> int | str:
    """An argparse type: a number of copies, or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a whole number of copies (at least 1) or "
                                         f"'auto', got {text!r}") from None


def storage_setup(args) -> None:
    """Object-storage settings of this command (inherited by forked workers and daemons),
    with a warning when they expose credentials (given on the command line, or in a file
    other users may read)."""
    from fanstore import storage

    text = getattr(args, "storage_options", None)
    options = storage.parse_storage_options(text)
    warnings = storage.exposure_warnings(text, options) if text else []
    env = current().storage_options
    if not text and env and env.startswith("@"):
        try:  # a bad one is reported where it is used (not every command uses S3)
            env_options = storage.parse_storage_options(env, "$FANSTORE_STORAGE_OPTIONS")
        except UsageError:
            env_options = {}
        warnings = storage.exposure_warnings(env, env_options, on_command_line=False)
    for line in warnings:
        print(f"fanstore: warning: {line}", file=sys.stderr, flush=True)
    storage.set_default_options(options)


def add_storage_args(s) -> None:
    s.add_argument("--storage-options", metavar="JSON|@FILE",
                   help="object-storage settings beyond the AWS environment (AWS_ENDPOINT_URL, "
                        "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, "
                        "AWS_REGION, AWS_SHARED_CREDENTIALS_FILE): s3fs keyword arguments, "
                        "plus 'retries' (default 5) and 'timeout' (seconds, default 30), "
                        "e.g. '{\"timeout\": 10}'; @FILE reads the JSON from FILE. Keep "
                        "credentials out of it: every user of the node can read a command "
                        "line (use the environment or a 0600 @FILE)")


def add_select_budget_args(s, for_pack: bool) -> None:
    g = s.add_argument_group("codec selection" + (" (with --codec auto)" if for_pack else ""))
    g.add_argument("--mode", choices=("sync", "prefetch"), default=None,
                   help="sync (default): decode on the read path; prefetch: decode overlaps "
                        "compute")
    rate = g.add_mutually_exclusive_group()
    rate.add_argument("--files-per-sec", type=positive_float, help="required files/s per node")
    rate.add_argument("--mb-per-sec", type=positive_float, help="required MB/s per node")
    g.add_argument("--cores", type=positive_int, default=None,
                   help="cores available for decompression per node (default: all here)")
    g.add_argument("--sample-mb", type=positive_float, default=200.0,
                   help="sample size in MB (default 200)")
    g.add_argument("--seed", type=int, default=0,
                   help="sampling seed (default 0); it also chooses the files that train "
                        "the dictionaries of zstd:L+dict")
    g.add_argument("--per-kind", action="store_true",
                   help="choose a codec per file kind (extension and size band)")
    g.add_argument("--storage-mb-per-sec", type=positive_float, default=None,
                   help="node-local read bandwidth in MB/s for the sync model (default: measured)")
    g.add_argument("--storage-latency-us", type=float, default=None,
                   help="one reader's time per random node-local read, in us, with --cores "
                        "readers at once (sync model; default: measured with the bandwidth, "
                        "0 when --storage-mb-per-sec is given)")
    g.add_argument("--reader", choices=("mount", "api"), default=None,
                   help="the read path the job will use, measured on this node: mount "
                        "(default; api where FUSE is missing): a temporary mount in the "
                        "--mode given, or api: the Python API")
    g.add_argument("--trials", type=nonneg_int, default=None, metavar="N",
                   help="finalists measured at most: each packed from a miniature of the "
                        "source and read cold the way the budget is defined (default 6; 0: "
                        "the model alone, in seconds)")
    g.add_argument("--rounds", type=positive_int, default=None, metavar="N",
                   help="cold passes over each finalist's trial, the median counts (default "
                        "3, and up to 2 more while they disagree by over 15%%; 1 is the "
                        "quickest and the noisiest)")

