"""The package installs as one `minispec`, with kernels/ mapped to `minispec.kernels`."""
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_is_not_a_top_level_module(tmp_path):
    # From outside the checkout (as a user's script runs), after importing minispec and transformers,
    # no top-level `kernels` may be importable: transformers would take it for Hugging Face's package.
    code = (
        "import importlib.util, sys, minispec, transformers\n"
        "import minispec.kernels\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "print(importlib.util.find_spec('kernels') is None, 'kernels' in sys.modules,"
        " is_kernels_available(), minispec.kernels.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False", "False", "minispec.kernels"]


def test_every_subpackage_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"minispec." + p.parent.relative_to(ROOT / "minispec").as_posix().replace("/", ".")
             for p in (ROOT / "minispec").rglob("__init__.py") if p.parent != ROOT / "minispec"}
    found |= {"minispec", "minispec.kernels"}
    assert found == listed


def test_minispec_import_does_not_import_triton(tmp_path):
    code = "import sys, minispec; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_checkpoints_stay_under_budget():
    """Everything shipped inside the package stays under 64 MB (bigger models come from a pip package)."""
    size = sum(p.stat().st_size for p in (ROOT / "minispec" / "checkpoints").rglob("*") if p.is_file())
    assert size < 64 * 10**6, f"minispec/checkpoints is {size / 1e6:.1f} MB, over the 64 MB budget"


def _module_name(path: Path) -> str:
    if path.is_relative_to(ROOT / "kernels"):
        parts = ["minispec", "kernels", *path.relative_to(ROOT / "kernels").with_suffix("").parts]
    else:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the minispec modules it imports, at the top or inside a function (a lazy import still
    makes the two modules depend on each other)."""
    import ast

    files = [*(ROOT / "minispec").rglob("*.py"), *(ROOT / "kernels").glob("*.py")]
    modules = {_module_name(p): p for p in files}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("minispec"):
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                edges |= subs or ({node.module} & modules.keys())
        graph[name] = edges - {name}
    return graph


def test_no_import_circle_in_the_package():
    graph = import_graph()
    state, cycles = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import circles:\n" + "\n".join(cycles)
