"""The layer rules of docs/architecture.md, enforced: imports point down, no cycles.

Every ``import`` in ``compressors/`` and ``fanstore/`` (module level and inside functions)
is parsed with ``ast``; an edge to a higher layer, between the daemon and the FUSE
frontends, to a third-party library outside the layer that owns it, or any cycle fails
the test with the offending edge or cycle named.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Layers, lowest first; a module may import its own layer and those below. The daemon's
#: MPI world and the FUSE frontends share a rank but never import each other; the kernel
#: protocol engine (fanstore.fuse.engine) is a layer of its own below the frontends, and the
#: daemon's MPI-free services (placement, the peer protocol, routing, staging, the control
#: requests) a layer below the MPI world.
DAEMON_SERVICES = tuple(f"fanstore.daemon.{m}" for m in (
    "jobenv", "placement", "protocol", "pacing", "transport", "routing", "peerwatch",
    "replicas", "service", "staging", "stagecopy", "stagefetch", "stagecheck",
    "stageowner"))
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("codecs", ("compressors",)),
    ("format", ("fanstore.version", "fanstore.errors", "fanstore.settings", "fanstore.safeio",
                "fanstore.unixsock", "fanstore.fuseflags", "fanstore.strictjson",
                "fanstore.mountspec",
                "fanstore.storage",
                "fanstore.units", "fanstore.format")),
    ("read core", ("fanstore.namespace", "fanstore.read", "fanstore.store", "fanstore.verify",
                   "fanstore.kinds")),
    ("services", ("fanstore.runtime", "fanstore.process", "fanstore.mounttable",
                  "fanstore.control", "fanstore.frontend", "fanstore.api", "fanstore.torch",
                  "fanstore.pack")),
    # Codec selection chooses and drives pack (its trials pack stores; it makes the policy
    # `fanstore pack` is handed); pack, a producer, never imports it.
    ("select", ("fanstore.select",)),
    ("daemon services", DAEMON_SERVICES),
    ("kernel engine", ("fanstore.fuse.engine",)),
    ("daemon", ("fanstore.daemon",)),
    ("fuse", ("fanstore.fuse",)),
    ("cli", ("fanstore.cli", "fanstore.launch", "fanstore.workerrank", "fanstore")),
]
_RANK = {name: rank for rank, (name, _) in enumerate(LAYERS)}
SIBLINGS = {"daemon": _RANK["daemon"], "fuse": _RANK["daemon"]}  # same rank
#: Third-party libraries only one part of the code may import.
OWNED = {"pyfuse3": ("fanstore.fuse",), "trio": ("fanstore.fuse",),
         "mpi4py": ("fanstore.daemon",), "s3fs": ("fanstore.storage",),
         "fsspec": ("fanstore.storage",), "botocore": ("fanstore.storage",)}
#: The engine speaks the kernel's protocol for any file system: it knows only its errors.
#: the engine's own modules, and FanStore's three standard-library-only leaves
ENGINE_MAY_IMPORT = ("fanstore.fuse.engine", "fanstore.errors", "fanstore.unixsock",
                     "fanstore.fuseflags")


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("compressors", "fanstore"):
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def layer_of(module: str) -> tuple[str, int]:
    best = None
    for rank, (name, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            inside = module == p or module.startswith(p + ".")
            if inside and (best is None or len(p) > best[2]):
                best = (name, SIBLINGS.get(name, rank), len(p))
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0], best[1]


def imports_of(module: str, path: Path) -> list[tuple[str, int]]:
    """(imported name, line) for every import in a file, resolved to our modules where
    they are ours (``from a import b`` names ``a.b`` when that is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in _walk_runtime(tree):
        if isinstance(node, ast.Import):
            out.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub if sub in MODULES else base, node.lineno))
    return out


def _walk_runtime(tree: ast.AST):
    """Every node, those under ``if TYPE_CHECKING:`` included: an import for annotations
    still ties the modules together (and makes a cycle as well as a real one)."""
    return ast.walk(tree)


def _edges() -> list[tuple[str, str, int]]:
    edges = []
    for module, path in MODULES.items():
        for name, line in imports_of(module, path):
            edges.append((module, name, line))
    return edges


EDGES = _edges()


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


#: A module owns one job; one that outgrows this is split along its seams
#: (docs/architecture.md, "How modules are cut").
MAX_MODULE_LINES = 500


def test_no_module_outgrows_its_job():
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
             for top in ("compressors", "fanstore") for path in (ROOT / top).rglob("*.py")}
    assert len(sizes) > 100
    assert {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES} == {}


#: A function that does one thing reads in one screen; a longer one is split at its seams.
MAX_FUNCTION_LINES = 80


def python_files() -> list[Path]:
    """Every .py file of the repository git tracks (the product, tests and tools); outside a
    git checkout, those under the repository's own top directories."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--", "*.py"],
                             capture_output=True, check=True, timeout=60).stdout
        paths = [ROOT / os.fsdecode(p) for p in out.split(b"\0") if p]
    except (OSError, subprocess.SubprocessError):
        paths = [p for top in ("compressors", "fanstore", "tests", "tools")
                 for p in (ROOT / top).rglob("*.py")] + list(ROOT.glob("*.py"))
    return [p for p in paths if p.is_file()]


def test_no_function_outgrows_a_screen():
    files = python_files()
    assert {f.relative_to(ROOT).parts[0] for f in files} >= {"fanstore", "tests", "tools"}
    long = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_imports_only_point_down():
    bad = []
    for src, dst, line in EDGES:
        if dst not in MODULES:
            continue
        (sname, srank), (dname, drank) = layer_of(src), layer_of(dst)
        if drank > srank or (srank == drank and sname != dname):
            bad.append(f"{MODULES[src].relative_to(ROOT)}:{line}: {src} ({sname}) imports "
                       f"{dst} ({dname})")
    assert not bad, "imports that point up or sideways:\n" + "\n".join(bad)


def test_the_engine_knows_nothing_of_fanstore():
    bad = [f"{MODULES[src].relative_to(ROOT)}:{line}: {src} imports {dst}"
           for src, dst, line in EDGES
           if (src == "fanstore.fuse.engine" or src.startswith("fanstore.fuse.engine."))
           and dst.startswith("fanstore")
           and not any(dst == p or dst.startswith(p + ".") for p in ENGINE_MAY_IMPORT)]
    assert not bad, "the kernel engine imports FanStore:\n" + "\n".join(bad)


def test_the_daemon_services_stay_free_of_mpi():
    """The MPI-free daemon modules import no mpi4py and no module of the MPI world."""
    services = set(DAEMON_SERVICES)
    bad = [f"{MODULES[src].relative_to(ROOT)}:{line}: {src} imports {dst}"
           for src, dst, line in EDGES if src in services
           and (dst.split(".")[0] == "mpi4py" or (dst.startswith("fanstore.daemon")
                                                  and dst not in services
                                                  and dst != "fanstore.daemon"))]
    assert not bad, "MPI in the daemon's services:\n" + "\n".join(bad)


def test_owned_libraries_stay_in_their_layer():
    bad = []
    for src, dst, line in EDGES:
        top = dst.split(".")[0]
        if top in OWNED and not any(src == o or src.startswith(o + ".") for o in OWNED[top]):
            bad.append(f"{MODULES[src].relative_to(ROOT)}:{line}: {src} imports {dst}")
    assert not bad, "third-party imports outside their owner:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for src, dst, _ in EDGES:
        if dst in MODULES and dst != src:
            graph[src].add(dst)
    # Tarjan's strongly connected components: any component of more than one module is
    # a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("src, dst", [
    ("fanstore.daemon.node", "fanstore.fuse.pyfuse3.operations"),
    ("fanstore.fuse.pyfuse3.operations", "fanstore.daemon.node"),
    ("fanstore.read.core", "fanstore.control"),
    ("fanstore.format.index", "fanstore.read.core"),
    ("compressors.zstd", "fanstore.errors"),
    ("fanstore.daemon.routing", "fanstore.daemon.world"),
    ("fanstore.fuse.engine.dispatch", "fanstore.fuse.kernelfs.handler"),
    ("fanstore.daemon.placement", "fanstore.fuse.engine.proto"),
    ("fanstore.pack.write", "fanstore.select.dictionaries"),
    ("fanstore.pack.plan", "fanstore.select.packpolicy"),
])
def test_the_rules_catch_a_forbidden_edge(src, dst):
    """The checker itself: each of these edges breaks a rule."""
    (sname, srank), (dname, drank) = layer_of(src), layer_of(dst)
    assert drank > srank or (srank == drank and sname != dname)


def test_the_parser_sees_lazy_and_relative_imports(tmp_path):
    """Imports inside functions and relative imports are edges too."""
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from fanstore.fuse.pyfuse3 import operations\n"
                    "from . import routing\nimport pyfuse3\n")
    names = {n for n, _ in imports_of("fanstore.daemon.x", path)}
    assert {"fanstore.fuse.pyfuse3.operations", "fanstore.daemon.routing", "pyfuse3"} <= names
    assert os.path.exists(MODULES["fanstore.daemon.node"])


def _environment_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, variable) of every read of a constant-named environment variable:
    ``os.environ.get(NAME)``, ``os.environ[NAME]``, ``os.getenv(NAME)``, ``NAME in
    os.environ``."""
    out = []

    def is_environ(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ"
                and isinstance(node.value, ast.Name) and node.value.id == "os")

    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in ("get", "pop")
                    and is_environ(f.value)) or (isinstance(f, ast.Attribute)
                                                 and f.attr == "getenv"):
                name = node.args[0].value
        elif isinstance(node, ast.Subscript) and is_environ(node.value) \
                and isinstance(node.slice, ast.Constant):
            name = node.slice.value
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) \
                and any(is_environ(c) for c in node.comparators):
            name = node.left.value
        if isinstance(name, str):
            out.append((node.lineno, name))
    return out


def test_fanstore_variables_are_read_in_settings_only():
    """Every FANSTORE_* variable is read by fanstore/settings.py alone (once, at the edge,
    into typed options): no module deeper in, and no worker process, reads one."""
    reads = []
    for module, path in MODULES.items():
        for line, name in _environment_reads(ast.parse(path.read_text(), str(path))):
            if name.startswith("FANSTORE_") and module != "fanstore.settings":
                reads.append(f"{path.relative_to(ROOT)}:{line} reads {name}")
    assert reads == []
    settings = MODULES["fanstore.settings"].read_text()
    assert "os.environ" in settings  # (the checker sees reads: current() has one)


def test_every_variable_settings_reads_is_in_its_table():
    from fanstore import settings

    doc = settings.__doc__ or ""
    assert all(f"``{name}``" in doc for name in settings.VARIABLES)
    arch = (ROOT / "docs" / "architecture.md").read_text()
    assert all(f"`{name}`" in arch for name in settings.VARIABLES)



# --------------------------------------------------------------------------- the edges

def _writes_to_the_terminal(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level function) of every ``print(...)`` and ``sys.stdout/stderr.write``;
    the function is "" at module level."""
    found = []
    for top in tree.body if isinstance(tree, ast.Module) else []:
        owner = top.name if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)) else ""
        for node in ast.walk(top):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if (isinstance(f, ast.Name) and f.id == "print") or (
                    isinstance(f, ast.Attribute) and f.attr == "write"
                    and isinstance(f.value, ast.Attribute)
                    and f.value.attr in ("stdout", "stderr")):
                found.append((node.lineno, owner))
    return found


def _entry_points(tree: ast.AST) -> set[str]:
    """The functions an ``if __name__ == "__main__":`` block calls: a process's own edge."""
    names: set[str] = set()
    for node in getattr(tree, "body", []):
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name)
                and node.test.left.id == "__name__"):
            names |= {n.func.id for n in ast.walk(node)
                      if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return names


def _prints_outside_the_edges(sources: dict[str, str]) -> list[str]:
    out = []
    for module, text in sources.items():
        if module == "fanstore.cli" or module.startswith("fanstore.cli."):
            continue
        tree = ast.parse(text)
        edge = _entry_points(tree)
        out += [f"{module}:{line}" for line, owner in _writes_to_the_terminal(tree)
                if owner not in edge]
    return out


def test_only_the_cli_and_process_entry_points_print():
    """Errors are translated at the edges: the CLI prints; so may the entry point of a
    process the CLI starts (a worker rank, a kernel-frontend process) before its logging
    is set up. Everything else raises or logs."""
    sources = {module: path.read_text() for module, path in MODULES.items()}
    assert _prints_outside_the_edges(sources) == []


def test_the_print_rule_catches_a_print():
    deep = "import sys\ndef f():\n    print('x')\n    sys.stderr.write('y')\n"
    main = "def main():\n    print('x')\nif __name__ == '__main__':\n    main()\n"
    assert _prints_outside_the_edges({"fanstore.read.core": deep}) == [
        "fanstore.read.core:3", "fanstore.read.core:4"]
    assert _prints_outside_the_edges({"fanstore.workerrank": main}) == []
    assert _prints_outside_the_edges({"fanstore.cli.pack": deep}) == []


def test_every_test_file_is_in_the_tests_by_level_table():
    arch = (ROOT / "docs" / "architecture.md").read_text()
    table = arch.split("## Tests by level", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"(test_\w+\.py)", table))
    files = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    assert files - listed == set(), "add them to docs/architecture.md, Tests by level"
    assert listed - files == set(), "the table names test files that do not exist"


def test_only_launch_and_workerrank_know_both_the_daemon_and_fuse():
    """docs/architecture.md: the composition roots ``launch`` and ``workerrank`` are the only
    modules outside the two packages that import both the daemon and a FUSE frontend."""
    knows: dict[str, set[str]] = {}
    for src, dst, _line in EDGES:
        if src.startswith(("fanstore.daemon", "fanstore.fuse")):
            continue
        for package in ("fanstore.daemon", "fanstore.fuse"):
            if dst == package or dst.startswith(package + "."):
                knows.setdefault(src, set()).add(package)
    both = sorted(m for m, packages in knows.items() if len(packages) == 2)
    assert both == ["fanstore.launch", "fanstore.workerrank"], both
