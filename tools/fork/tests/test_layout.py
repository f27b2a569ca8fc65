"""The layout of tools/fork: packages by family on a small core, no import cycle, no verb importing a verb."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tools.fork.cli import VERBS

TOOLS = Path(__file__).resolve().parents[2]  # tools/
FAMILIES = {"queue", "rebase", "follow", "deploy", "testing", "npu"}
VERB_MODULES = {f"tools.fork.{module}" for module, _ in VERBS.values()}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(TOOLS.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(TOOLS.rglob("*.py")) if "__pycache__" not in p.parts}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules under tools/ that `name` imports: every `import`/`from` statement, in functions too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import mod` imports pkg.mod when that is a module, else a name of pkg
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a package: the nearest module
                target = target.rpartition(".")[0]
            if target and target != name and not known.isdisjoint({target}):
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    # a package's __init__ is not a dependency worth a cycle: drop package names as targets
    packages = {n for n, p in modules.items() if p.name == "__init__.py"}
    return {n: _imports(n, p, known) - packages for n, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_imports_inside_functions():
    graph = _graph()
    assert "tools.fork.core.config" in graph["tools.fork.cli"]  # imported inside main()
    assert "tools.fork.core.errors" in graph["tools.fork.cli"]


def test_no_import_cycle():
    cycles = _cycles(_graph())
    assert not cycles, cycles


def test_verbs_import_only_shared_modules():
    graph = _graph()
    bad = [f"{v} imports {w}" for v in sorted(VERB_MODULES) for w in sorted(graph[v] & VERB_MODULES)]
    assert not bad, "\n".join(bad)


def test_shared_modules_import_no_verb():
    graph = _graph()
    shared = [n for n in graph if n.startswith("tools.fork.") and n not in VERB_MODULES and ".tests" not in n]
    bad = [f"{n} imports {w}" for n in sorted(shared) for w in sorted(graph[n] & VERB_MODULES)]
    # cli is the dispatcher: it loads the verbs with importlib, which is no import statement
    assert not bad, "\n".join(bad)


def test_each_verb_is_a_cmd_module_of_a_family_package():
    bad = []
    for verb, (module, _summary) in VERBS.items():
        family, _, name = module.partition(".")
        want = f"cmd_{verb.replace('-', '_')}"  # npu-report: cmd_npu_report
        if family not in FAMILIES or name != want:
            bad.append(f"{verb}: tools.fork.{module} (want tools.fork.<family>.{want})")
    found = {n for n in _modules() if n.rpartition(".")[2].startswith("cmd_")}
    assert not bad and found == VERB_MODULES, (bad, sorted(found ^ VERB_MODULES))


def test_the_core_imports_no_family():
    graph = _graph()
    bad = [
        f"{n} imports {w}"
        for n in sorted(graph)
        if n.startswith("tools.fork.core.")
        for w in sorted(graph[n])
        if w.startswith("tools.fork.") and not w.startswith("tools.fork.core.")
    ]
    assert not bad, "\n".join(bad)


def test_only_the_entry_point_imports_the_command_line():
    """A verb calls other families' functions, never another verb's command line (cli.main)."""
    graph = _graph()
    bad = [
        n for n in sorted(graph) if "tools.fork.cli" in graph[n] and n != "tools.fork.__main__" and ".tests" not in n
    ]
    assert not bad, bad


_ONE_SENTENCE = re.compile(r"^\S.*\.$")


def test_each_module_opens_with_one_sentence_saying_its_job():
    bad = []
    for name, path in _modules().items():
        if not name.startswith("tools.fork") or not path.read_text().strip():
            continue  # an empty package marker has nothing to say
        doc = ast.get_docstring(ast.parse(path.read_text()))
        first = (doc or "").splitlines()[0].strip() if doc else ""
        # one sentence: it ends the line, and no other sentence ends before it
        if not first or not _ONE_SENTENCE.match(first) or re.search(r"[.!?] [A-Z]", first[:-1]):
            bad.append(f"{path.relative_to(TOOLS.parent)}: {first or '(no docstring)'!r}")
    assert not bad, "\n".join(bad)
