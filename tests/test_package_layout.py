"""The package's shape: files stay small, module-level imports form no cycle, ``mlakit.arch``
stays torch-free, and no module reaches into another's private names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mlakit"
MAX_LINES = 450


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = ROOT, package: str = "mlakit") -> dict[str, Path]:
    """Every module of PACKAGE under ROOT: dotted name -> file."""
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``import from`` names, relative levels resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def module_level_imports(path: Path, module: str, known: set[str]) -> set[str]:
    """mlakit modules MODULE imports when it is imported: top-level statements, and the bodies of
    top-level if/try blocks, but not functions, classes or ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(stmts):
        for node in stmts:
            if isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                    visit(block)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, is_package, node)
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)  # a submodule imported by name

    visit(tree.body)
    return {m for m in found if m in known and m != module}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the mlakit modules it imports at module level."""
    mods = modules(root)
    return {m: module_level_imports(p, m, set(mods)) for m, p in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (cycle := dfs(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def private_uses(root: Path = ROOT, packages: tuple[str, ...] = ("mlakit", "tests")) -> list[str]:
    """Private names of a mlakit or tests module used by another module: ``from m import _name``,
    or ``m._name`` where ``m`` was imported as a module (``__future__`` and dunders aside)."""
    found = []
    for package in packages:
        for module, path in modules(root, package).items():
            tree = ast.parse(path.read_text())
            imported_modules = set()  # local names bound to one of our modules
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    target = _resolve(module, path.name == "__init__.py", node)
                    if target.split(".")[0] not in packages:
                        continue
                    for a in node.names:
                        if _private(a.name):
                            found.append(f"{module} imports {target}.{a.name}")
                        imported_modules.add(a.asname or a.name)  # a submodule, or harmlessly a function
                elif isinstance(node, ast.Import):
                    imported_modules.update(
                        a.asname for a in node.names if a.asname and a.name.split(".")[0] in packages
                    )
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                    if node.value.id in imported_modules and _private(node.attr):
                        found.append(f"{module} uses {node.value.id}.{node.attr}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_file_in_the_package_is_over_the_line_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these files (at most {MAX_LINES} lines each): {long}"


def test_module_level_imports_form_no_cycle():
    graph = import_graph()
    assert "mlakit.convert.assemble" in graph["mlakit.pipeline.run_state"]  # the parser sees relative imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle) + "; move the shared part into its own module"


def test_the_cycle_finder_reports_a_cycle(tmp_path):
    pkg = tmp_path / "mlakit"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .a import x\nfrom ..c import y\n")
    (pkg / "c.py").write_text("import mlakit.sub.a\n")
    assert find_cycle(import_graph(tmp_path)) == ["mlakit.c", "mlakit.sub.a", "mlakit.sub.b", "mlakit.c"]
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import mlakit.sub.a\n"
    )
    assert find_cycle(import_graph(tmp_path)) is None
    (pkg / "c.py").write_text("from .sub import _hidden, a\nfrom os import _exit\na._x\n")
    assert private_uses(tmp_path, ("mlakit",)) == [
        "mlakit.c imports mlakit.sub._hidden",
        "mlakit.c uses a._x",
    ]


def test_no_module_uses_another_modules_private_names():
    found = private_uses()
    assert not found, (
        f"make these public (test seams too) or move them into the module that uses them: {found}"
    )


def test_importing_mlakit_arch_does_not_import_torch():
    code = (
        "import sys\n"
        "import mlakit.arch, mlakit.arch.names, mlakit.arch.families\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "", (
        f"import mlakit.arch pulled in {out.stdout.strip()}; keep arch/ torch-free"
    )
