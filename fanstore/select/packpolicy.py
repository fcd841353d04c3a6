"""The codec policy of a pack: which codec each file gets and which files go into solid
blocks, from what the user asked for (``--codec``, ``--solid-kb``).

==========================  =============================================================
``--codec``                 policy
==========================  =============================================================
(none)                      the quick selection, a codec per file kind, and solid blocks
                            of 32 KiB for kinds of small files where they store best
                            (``fanstore.select.quick``); a streamed source (tar, zip, S3):
                            zstd:3, since nothing can be sampled before it is read
``auto``                    the full selector (``fanstore.select``): its codec, or with
                            ``--per-kind`` its codec per kind; refused (exit status 3)
                            when no codec meets the budget
``NAME[:ARG...]``           that codec for every file
``...+dict``                zstd:L with a dictionary trained per kind of many small files
                            (other kinds plain zstd:L)
``...+solidNk``             with any of the above, files of at most N KiB packed back to
                            back into solid blocks of N KiB (format v2); ``--solid-kb N`` is
                            the same setting (given both, they must agree)
==========================  =============================================================

``--kind-codec KIND=SPEC`` (with a pinned ``--codec``, a directory source) gives one kind
its own spec over the rest: what a per-kind selection's report prints, so that pack stores
each kind as the selection measured it (a ``+dict`` spec takes the kind's dictionary,
trained as the selection trained it).

The spec grammar is ``compressors.spec``'s, so every name ``fanstore select`` reports is a
``--codec`` value. :func:`plan_policy` is the one entry: it returns the
:class:`~fanstore.pack.plan.CodecPolicy`, the index metadata to record (the selection's
report) and the scan of a directory source it made on the way (pack reuses it).
:func:`policy_from_selection` turns a selector's result into a policy.

It lives in :mod:`fanstore.select`, not in :mod:`fanstore.pack`: choosing codecs is the
selection's job, and it drives pack (its trials pack stores); pack is a producer that is
handed a :class:`~fanstore.pack.plan.CodecPolicy` and imports nothing of the selection
(``tests/test_layers.py`` puts ``select`` a layer above ``pack``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from compressors import CodecError, CodecSpec, ZstdCodec, parse_codec_spec, parse_spec
from fanstore.errors import BudgetNotMetError, UsageError
from fanstore.pack.options import Symlinks, check_symlinks
from fanstore.pack.plan import CodecPolicy
from fanstore.pack.scan import ScanResult, scan_tree

if TYPE_CHECKING:
    from fanstore.select.options import SelectionOptions
    from fanstore.select.quick import QuickSelection
    from fanstore.select.result import SelectionResult
    from fanstore.select.sample import SourceFile

log = logging.getLogger(__name__)

#: ``--codec auto``: the full selector.
AUTO = "auto"
#: The codec of a streamed source packed without ``--codec``, and of a tree whose scan
#: found entries it cannot pack (pack reports those before it uses a codec).
STREAM_DEFAULT = "zstd:3"


@dataclass
class PolicyRequest:
    """What the user asked for. ``codec``: the ``--codec`` text (None: the default, a quick
    selection); ``solid_kb``: ``--solid-kb`` (None: not given, 0: no solid blocks);
    ``symlinks``: ``--symlinks`` (the scan made here is the one pack uses, so it must be
    made as pack would make it); ``seed``: ``--seed``, which also chooses the files that
    train ``+dict`` dictionaries (as ``fanstore select --seed`` does); ``selection``: makes
    the selector's options for ``--codec auto`` (called only then); ``notify``: shows one
    line to the user (the CLI prints it)."""

    codec: str | None = None
    solid_kb: int | None = None
    chunk_size: int = 1 << 20
    skip_unreadable: bool = False
    symlinks: Symlinks = Symlinks.STORE
    seed: int = 0
    kind_codecs: dict[str, str] = field(default_factory=dict)  # --kind-codec KIND=SPEC
    selection: Callable[[], SelectionOptions] | None = None
    notify: Callable[[str], None] = field(default=lambda text: log.warning("%s", text))

    def check(self) -> None:
        """What can be refused before the source is looked at: ``--solid-kb`` larger than a
        chunk."""
        if self.solid_kb is not None and self.solid_kb * 1024 > self.chunk_size:
            raise UsageError(f"--solid-kb {self.solid_kb} is larger than the chunk size "
                             f"({self.chunk_size >> 10} KiB; raise --chunk-kb)")


@dataclass
class PolicyPlan:
    """A pack's codec policy, the index metadata to record with it (``"selection"``: what a
    selector chose and why), the scan of a directory source made on the way (or None), and
    the full selector's one-line summary (``--codec auto``; None otherwise)."""

    policy: CodecPolicy
    meta: dict[str, Any] = field(default_factory=dict)
    scan: ScanResult | None = None
    summary: str | None = None


def plan_policy(src: str, request: PolicyRequest, source_kind: str = "directory",
                scan: ScanResult | None = None) -> PolicyPlan:
    """The policy for packing ``src`` (a ``source_kind`` of ``fanstore.pack.sources``) as
    ``request`` asks; ``scan``: the directory's scan when the caller made it (else it is
    made here when needed, and returned in the plan for pack to reuse). Raises :class:`UsageError` for a spec that is not one or does not go
    with the source, :class:`BudgetNotMetError` when ``--codec auto`` finds no codec fast
    enough."""
    check_symlinks(request.symlinks, source_kind)
    text = request.codec
    spec = None if text in (None, AUTO) else _parse(text)
    solid_kb = _solid_kb(text, spec, request)
    if solid_kb and spec is not None and spec.codec.declines:
        raise UsageError(f"--solid-kb: {spec.codec.spec} takes whole files, not solid blocks")
    if request.kind_codecs and (spec is None or source_kind != "directory"):
        raise UsageError("--kind-codec goes with a pinned --codec (not auto, not the default) "
                         "and a directory source")
    if source_kind != "directory":
        # The selectors and solid blocks sample and plan a tree; a streamed source is packed
        # as it is read, with one codec.
        if text == AUTO or (spec is not None and spec.dictionary) or solid_kb:
            what = ("--codec auto" if text == AUTO else
                    "--solid-kb" if request.solid_kb else f"--codec {text}")
            raise UsageError(f"{what} needs a directory source; with a {source_kind} source "
                             "give a codec (e.g. --codec zstd:3)")
        if spec is None:
            request.notify(f"a {source_kind} source is packed with {STREAM_DEFAULT} (the quick "
                           "selection samples a directory; --codec pins another)")
            spec = CodecSpec(parse_spec(STREAM_DEFAULT))
    if text == AUTO:
        plan = _auto(src, request)
    elif spec is None or spec.dictionary:
        # (else pack reports the source)
        if scan is None and os.path.isdir(src):
            scan = scan_tree(src, symlinks=request.symlinks)
        if scan is not None and scan.problems and not request.skip_unreadable:
            # pack lists the problems and stops before any codec is used
            return PolicyPlan(CodecPolicy(parse_spec(STREAM_DEFAULT)), scan=scan)
        files = _files(scan)
        if spec is None:
            plan = _quick(src, files, request)
        else:
            plan = PolicyPlan(_dict_policy(src, files, spec, request))
        plan.scan = scan
    else:
        plan = PolicyPlan(CodecPolicy(spec.codec))
    if solid_kb is not None:
        block = solid_kb * 1024
        plan.policy.solid = block
        plan.policy.solid_by_kind = {kind: block for kind in plan.policy.by_kind}
    if plan.scan is None:
        plan.scan = scan
    if request.kind_codecs:
        _kind_codecs(src, plan, request)
    return plan


def _parse(text: str) -> CodecSpec:
    try:
        return parse_codec_spec(text)
    except CodecError as exc:
        raise UsageError(f"--codec: {exc}") from None


def _solid_kb(text: str | None, spec: CodecSpec | None, request: PolicyRequest) -> int | None:
    """The solid block size asked for, in KiB: by ``+solidNk`` or ``--solid-kb`` (None:
    neither; 0: none)."""
    suffix = spec.solid_kb if spec is not None else 0
    if not suffix:
        return request.solid_kb
    if request.solid_kb is not None and request.solid_kb != suffix:
        raise UsageError(f"--codec {text} and --solid-kb {request.solid_kb} ask for different "
                         "solid blocks (give one of them)")
    if suffix * 1024 > request.chunk_size:
        raise UsageError(f"--codec {text}: solid blocks of {suffix} KiB are larger than the "
                         f"chunk size ({request.chunk_size >> 10} KiB; raise --chunk-kb)")
    return suffix


def _files(scan: ScanResult | None) -> list[SourceFile]:
    from fanstore.select.sample import source_files

    return [] if scan is None else source_files(scan)


def _quick(src: str, files: list[SourceFile], request: PolicyRequest) -> PolicyPlan:
    """The default: a quick selection per kind, said in one line."""
    from fanstore.select import quick

    solid_kb = quick.SOLID_BLOCK >> 10 if request.solid_kb is None else request.solid_kb
    choice = quick.quick_select(files, request.chunk_size, root=src, solid_kb=solid_kb)
    request.notify(choice.line())
    return PolicyPlan(quick_policy(choice), {"selection": choice.to_json()})


def quick_policy(choice: QuickSelection) -> CodecPolicy:
    """The policy of a quick selection: its codec (and solid blocks) per kind over the
    fallback, zstd:3."""
    from fanstore.select.quick import FALLBACK

    default = parse_spec(FALLBACK)
    solid = choice.solid()
    return CodecPolicy(default, {k: c for k, c in choice.codecs().items()
                                 if c != default or k in solid}, 0, solid)


def _dict_policy(src: str, files: list[SourceFile], spec: CodecSpec,
                 request: PolicyRequest) -> CodecPolicy:
    """``zstd:L+dict``: zstd at level L, with a dictionary per kind of many small files
    (kinds without one keep plain zstd:L), trained as ``fanstore select`` trains the ones
    it measures (the same bytes for the same source and seed)."""
    from fanstore.select.dictionaries import train_dictionaries

    codec = spec.codec
    assert isinstance(codec, ZstdCodec)  # the grammar allows +dict on zstd:L only
    dicts = train_dictionaries(files, request.chunk_size, request.seed)
    return CodecPolicy(codec, {kind: ZstdCodec(codec.level, dict_data=data)
                               for kind, data in dicts.items()})


def _kind_codecs(src: str, plan: PolicyPlan, request: PolicyRequest) -> None:
    """``--kind-codec KIND=SPEC``: each named kind's codec and solid blocks over the rest, as
    a per-kind selection measured them (``SelectionResult.mix_policy``); ``+dict`` takes the
    kind's dictionary (plain zstd:L for a kind that has none)."""
    from fanstore.select.dictionaries import train_dictionaries

    specs = {}
    for kind, text in sorted(request.kind_codecs.items()):
        try:
            specs[kind] = parse_codec_spec(text)
        except CodecError as exc:
            raise UsageError(f"--kind-codec {kind}={text}: {exc}") from None
        if specs[kind].solid_kb * 1024 > request.chunk_size:
            raise UsageError(f"--kind-codec {kind}={text}: solid blocks larger than the chunk "
                             f"size ({request.chunk_size >> 10} KiB; raise --chunk-kb)")
    dicts: dict[str, bytes] = {}
    if any(spec.dictionary for spec in specs.values()):
        if plan.scan is None:
            plan.scan = scan_tree(src, symlinks=request.symlinks)
        if not plan.scan.problems or request.skip_unreadable:  # (else pack stops first)
            dicts = train_dictionaries(_files(plan.scan), request.chunk_size, request.seed)
    for kind, spec in specs.items():
        codec = spec.codec
        if spec.dictionary and kind in dicts:
            codec = ZstdCodec(codec.level, dict_data=dicts[kind])
        plan.policy.by_kind[kind] = codec
        plan.policy.solid_by_kind[kind] = spec.solid_kb * 1024


def _auto(src: str, request: PolicyRequest) -> PolicyPlan:
    """``--codec auto``: run the full selector and pack with its choice."""
    from fanstore.select.options import SelectionOptions
    from fanstore.select.report import summary_line, to_json
    from fanstore.select.selector import run_selection

    options = (request.selection() if request.selection is not None
               else SelectionOptions(chunk_size=request.chunk_size))
    result = run_selection(src, options)
    policy = policy_from_selection(result)
    return PolicyPlan(policy, {"selection": to_json(result)}, summary=summary_line(result))


def policy_from_selection(result: SelectionResult) -> CodecPolicy:
    """The pack policy for a selection: its codec, or its per-kind codecs when that mix
    meets the budget.

    Raises :class:`BudgetNotMetError` if the budget was not met: pack does not silently
    store data with a codec too slow for the job (the message names the ``--codec`` that
    packs with the fastest candidate anyway).
    """
    from fanstore.select.report import not_met_message

    if not result.budget_met:
        raise BudgetNotMetError(not_met_message(result) + "; to pack anyway, give the "
                                f"codec: --codec {result.chosen}")
    if result.per_kind is not None and result.per_kind_met:
        return result.mix_policy(result.per_kind)
    return result.candidate(result.chosen).policy()


__all__ = ["AUTO", "PolicyPlan", "PolicyRequest", "plan_policy", "policy_from_selection",
           "quick_policy"]
