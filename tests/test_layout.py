"""The package's layering, read from the source with ``ast`` (nothing is imported or run).

Two parts. The library is what a user's own training loop imports (formats, gemm_geometry,
transforms, patterns, policy, kernels, ops, config, layer, linear, shared_input, convert,
modes_io, drift, hf, calibration, quantized_all_gather, oscillation, schedule, recipes, hf_trainer, titan,
atomic_io, safe_paths: every top-level module or package not in ``HARNESS``). The harness is
what ``adahop`` the program adds around it, the packages of ``HARNESS``, bottom to top. The rules:

- the library never imports a harness package;
- a harness package imports the library and harness packages at or below its own level, never
  one above it (``train`` may read ``data``; ``data`` may not read ``train``);
- there is no import cycle between modules, nor between top-level packages.

Imports inside functions count as well: a lazy import is still a dependency, and a cycle through
one breaks as soon as both ends run.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "adahop"

# The harness, bottom to top. A new top-level module or package is library unless listed here.
HARNESS = [
    "data",  # text sources, tokenizers, the token corpus, zero-shot task items, the SmolLM2 pin
    "llama",  # adahop's Llama and the pretrained weights loaded into it
    "train",  # the trainer, its run folder and checkpoints, evaluation, distributed running
    "analyze",  # the outlier study (adahop analyze)
    "cli",  # the command line, on top of everything
]


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root`` (a package folder)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def module_imports(root: Path) -> dict[str, set[str]]:
    """Each module's imports of other modules of the package (``from a.b import c`` counts as
    ``a.b.c`` where that is a module, else as ``a.b``)."""
    names = module_names(root)
    graph = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    deps.add(sub if sub in names else target)
        graph[name] = {d for d in deps if d in names and d != name}
    return graph


def unit(module: str) -> str:
    """The top-level module or package a module belongs to (``adahop`` itself for the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
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


def layering_problems(root: Path, harness: list[str]) -> list[str]:
    """Every import that breaks the rules of the module docstring, one line each."""
    graph = module_imports(root)
    level = {name: i for i, name in enumerate(harness)}
    problems = []
    for module, deps in sorted(graph.items()):
        for dep in sorted(deps):
            src, dst = unit(module), unit(dep)
            if src == dst or dst not in level:
                continue
            if src not in level:
                problems.append(f"library {module} imports harness {dep}")
            elif level[dst] > level[src]:
                problems.append(f"{module} ({src}) imports {dep} from {dst}, above it")
    for component in cycles(graph):
        problems.append(f"import cycle between modules: {' <-> '.join(component)}")
    units = {}
    for module, deps in graph.items():
        units.setdefault(unit(module), set()).update(unit(d) for d in deps if unit(d) != unit(module))
    for component in cycles(units):
        problems.append(f"import cycle between packages: {' <-> '.join(component)}")
    return problems


def test_the_harness_list_names_packages_that_exist():
    present = {unit(m) for m in module_names(SRC)}
    assert [h for h in HARNESS if h not in present] == []


def test_the_package_is_layered():
    assert layering_problems(SRC, HARNESS) == []


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_check_finds_upward_imports_and_cycles(tmp_path):
    """The checker itself, on a small package with one of each problem."""
    pkg = write(tmp_path / "pkg", {
        "__init__.py": "",
        "core.py": "def f():\n    from pkg.train import loop\n",  # library -> harness (a lazy import)
        "train/__init__.py": "",
        "train/loop.py": "from pkg.report import figures\n",  # train -> report, above it
        "report/__init__.py": "",
        "report/figures.py": "from pkg.train import loop\n",  # a cycle train <-> report
        "a.py": "from . import b\n",  # a cycle between library modules, through a relative import
        "b.py": "from pkg.a import f\n",
    })
    assert layering_problems(pkg, ["train", "report"]) == [
        "library pkg.core imports harness pkg.train.loop",
        "pkg.train.loop (train) imports pkg.report.figures from report, above it",
        "import cycle between modules: pkg.a <-> pkg.b",
        "import cycle between modules: pkg.report.figures <-> pkg.train.loop",
        "import cycle between packages: a <-> b",
        "import cycle between packages: report <-> train",
    ]
