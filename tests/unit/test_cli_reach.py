"""The command line stays on the public side of the library: no command reaches into ``repo.plumbing`` (not a
stable API) or into another subpackage's private module, so that the library's insides can change without the
CLI noticing. The CLI imports ``ckptrepo``, ``ckptrepo.errors``, ``ckptrepo.tools``, ``ckptrepo.ui`` and its own
modules, nothing else of the package (type-checking imports included: they name the same insides)."""
from __future__ import annotations

import ast
from pathlib import Path

import ckptrepo

CLI = Path(ckptrepo.__file__).parent / "cli"
ALLOWED = {"ckptrepo", "ckptrepo.errors", "ckptrepo.tools", "ckptrepo.ui"}


def _imported(node: ast.AST) -> list[str]:
    """The ckptrepo modules an import statement names: ``from X import y`` names ``X.y`` where ``y`` is a
    module of the package itself (lower case), of the CLI, or private (``_y``), and ``X`` otherwise."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "ckptrepo"]
    if not (isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ckptrepo"):
        return []
    own = node.module in ("ckptrepo", "ckptrepo.cli")
    return [f"{node.module}.{a.name}" if a.name.startswith("_") or (own and a.name.islower()) else node.module
            for a in node.names]


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("plumbing", "_plumbing"):
            found.append(f"{path.name}:{node.lineno}: reaches into .{node.attr}")
        for module in _imported(node):
            parts = module.split(".")
            if module.startswith("ckptrepo.cli."):
                continue
            if any(p.startswith("_") for p in parts[1:]):
                found.append(f"{path.name}:{node.lineno}: imports the private module {module}")
            elif module not in ALLOWED and not (module.startswith("ckptrepo.") and f"ckptrepo.{parts[1]}" in
                                                 ALLOWED and len(parts) == 2):
                found.append(f"{path.name}:{node.lineno}: imports {module}, beyond the public facades")
    return found


def test_no_cli_module_reaches_into_plumbing_or_a_private_module():
    modules = sorted(CLI.glob("*.py"))
    assert len(modules) >= 9, modules
    problems = [p for path in modules for p in _problems(path)]
    assert not problems, "\n".join(problems)


def test_the_check_catches_both_kinds_of_reach(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import ckptrepo.tools._width as w\nfrom ckptrepo.core._manifest import x\n"
                   "from ckptrepo.maintenance import _lost\nfrom ckptrepo.saving import Snapshotter\n"
                   "def f(repo):\n    return repo.plumbing.store\n")
    problems = _problems(bad)
    assert len(problems) == 5, problems
    assert any("plumbing" in p for p in problems)
    assert any("ckptrepo.saving" in p for p in problems)


def test_no_cli_module_is_longer_than_400_lines():
    long = {p.name: n for p in CLI.glob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
