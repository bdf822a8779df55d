"""The house rules that keep the code readable, checked on the tree: no import cycle in
``python/ferryman`` (function-local imports included), no Python module over 300 lines, no Rust
file over 400 lines before its tests, a README of at most 150 lines, and nothing that cites files
outside the repository."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python"
NEEDLE = "../" + "shared"  # spelled so that this file does not match itself


def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for path in (PACKAGE / "ferryman").rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its body (``from a import b`` counts
    as an import of ``a.b`` where that is a module, else of ``a``)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in mods.items():
        here = name if is_pkg else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    deps.add(sub if sub in mods else base)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    graph = import_graph()
    assert "ferryman.cli" in graph and "ferryman.engine_args" in graph["ferryman.cli.serve"]
    assert cycles(graph) == []


def test_nothing_outside_the_cli_imports_it() -> None:
    graph = import_graph()
    users = {m for m, deps in graph.items() if any(d.startswith("ferryman.cli") for d in deps)}
    assert {u for u in users if not u.startswith("ferryman.cli")} == {"ferryman.__main__"}


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / line for line in out.stdout.splitlines()]


def test_module_sizes() -> None:
    big = [
        f"{p.relative_to(ROOT)}: {n}"
        for p in _tracked("python/*.py")
        if (n := len(p.read_text().splitlines())) > 300
    ]
    assert not big, big
    rust = []
    for p in _tracked("src/*.rs"):
        if "/tests/" in str(p) or "/benches/" in str(p) or "/examples/" in str(p):
            continue
        lines = p.read_text().splitlines()
        body = next((i for i, line in enumerate(lines) if line.strip() == "#[cfg(test)]"), len(lines))
        if body > 400:
            rust.append(f"{p.relative_to(ROOT)}: {body}")
    assert not rust, rust


def test_readme_is_a_product_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150
    start = next(i for i, line in enumerate(lines) if line.startswith("```"))
    end = lines.index("```", start + 1)
    first_block = [line.split("#")[0] for line in lines[start + 1 : end]]  # commands, not comments
    assert [line.split()[0] for line in first_block if line.strip()] == [
        "./scripts/run.sh",
        "./scripts/test.sh",
    ]


def test_nothing_cites_files_outside_the_repository() -> None:
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in _tracked()
        if p.suffix in {".md", ".py", ".rs", ".sh", ".toml", ".pyi", ".txt"} and p.exists()
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if NEEDLE in line
    ]
    assert hits == [], hits
