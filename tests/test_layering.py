"""The layout's rules, read from the source: which package may import which, no circles,
and a front-end process that never loads the BLAS (it runs no model)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("gmlx", "ipc", "workers")
FORBIDDEN = {  # package -> top-level modules it must never import (lazily or not)
    "gmlx": {"ipc", "workers", "zmq"},
    "ipc": {"mlx", "mlx_lm", "gmlx"},
}
TEST_SUPPORT = {path.stem for path in (REPO / "tests").glob("*.py")} | {"tests"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """Every import statement in the file, at any depth (lazy imports too), as
    (module, names): ("a.b", ()) for `import a.b`, ("a", ("b", "c")) for `from a import b, c`."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, tuple(alias.name for alias in node.names)))
    return found


def imported_names(path: Path) -> list[str]:
    return [base for base, _ in imports(path)]


def project_sources(*roots: str) -> list[Path]:
    return sorted(p for root in roots for p in (REPO / root).rglob("*.py"))


def test_packages_import_only_downward():
    violations = []
    for package, forbidden in FORBIDDEN.items():
        for path in project_sources(package):
            for name in imported_names(path):
                if name.split(".")[0] in forbidden:
                    violations.append(f"{path.relative_to(REPO)} imports {name}")
    assert not violations, "\n".join(violations)


def test_scripts_import_no_tests():
    violations = [f"{p.relative_to(REPO)} imports {n}" for p in project_sources("scripts")
                  for n in imported_names(p) if n.split(".")[0] in TEST_SUPPORT]
    assert not violations, "\n".join(violations)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in project_sources(*PACKAGES)}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for base, names in imports(path):
            submodules = {f"{base}.{n}" for n in names} & modules.keys()  # `from pkg import module`
            edges |= submodules or ({base} & modules.keys())
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_importing_the_client_loads_no_mlx_and_no_blas():
    from gmlx.platform.blas import find_blas_library

    code = ("import sys, ipc.client; print([m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'gmlx')]);"
            "print(open('/proc/self/maps').read() if sys.platform.startswith('linux') else '')")
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=REPO, check=True)
    loaded, _, maps = out.stdout.partition("\n")
    assert loaded == "[]"
    timed = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert timed and not [m for m in timed if m.split(".")[0] in ("mlx", "mlx_lm", "gmlx")]
    blas_path, _ = find_blas_library()
    if blas_path:
        assert os.path.realpath(blas_path) not in maps


def mapped_files(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/maps (Linux)")
def test_frontend_process_maps_no_blas():
    from gmlx.platform.blas import INTERPOSER_PATH, describe_blas
    from serving_support import Server

    blas_path = describe_blas(measure=False)["library"]
    if blas_path is None:
        pytest.skip("no system BLAS loaded here to look for")
    server = Server(drafter="none")
    try:
        frontend_maps = mapped_files(server.frontend_pid())
        supervisor_maps = mapped_files(server.proc.pid)
        worker_maps = [mapped_files(pid) for pid in server.worker_pids()]
    finally:
        assert server.terminate() == 0
    real_blas = os.path.realpath(blas_path)
    for maps in (frontend_maps, supervisor_maps):
        assert real_blas not in maps and str(INTERPOSER_PATH) not in maps and "libmlx" not in maps
    assert worker_maps and all(real_blas in maps for maps in worker_maps)  # the check can see a BLAS
