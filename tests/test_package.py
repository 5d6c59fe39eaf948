"""The package installs as one `minispec`, with kernels/ (linked as minispec/kernels) as `minispec.kernels`.

kernels/ has no __init__.py, so from the repository root (first on sys.path under `python -m`, pytest and a
notebook kernel started there) a top-level `import kernels` meets it only as a namespace portion, and
Hugging Face's `kernels` package, a regular package further down sys.path, wins: the import system keeps
looking past a namespace portion. transformers (5.25) depends on that package and imports it.
"""
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
HF_KERNELS = Path(importlib.metadata.distribution("kernels").locate_file("kernels"))  # transformers' dependency

WHICH_KERNELS = (
    "import json, kernels, minispec, minispec.kernels.verify, transformers\n"
    "from transformers.integrations import hub_kernels\n"  # the import that failed when kernels/ shadowed it
    "print(json.dumps({'kernels': kernels.__file__, 'minispec.kernels': list(minispec.kernels.__path__),"
    " 'verify': minispec.kernels.verify.__file__}))\n"
)


def test_from_the_repository_root_import_kernels_is_hugging_faces_package():
    out = subprocess.run([sys.executable, "-c", WHICH_KERNELS], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout)
    assert Path(found["kernels"]) == HF_KERNELS / "__init__.py"
    assert [Path(p).resolve() for p in found["minispec.kernels"]] == [ROOT / "kernels"]
    assert Path(found["verify"]).resolve() == ROOT / "kernels" / "verify.py"


def test_from_outside_the_checkout_the_same():
    out = subprocess.run([sys.executable, "-c", WHICH_KERNELS], cwd=ROOT.parent, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert Path(json.loads(out.stdout)["kernels"]) == HF_KERNELS / "__init__.py"


def test_python_m_pytest_from_the_repository_root_collects_every_test_module():
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-o", "addopts=", "tests"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    modules = {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}
    assert modules == {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")}


def test_a_notebook_kernel_started_at_the_repository_root_imports_both(tmp_path):
    """A notebook kernel whose working directory is the repository root (a notebook saved there, or
    `jupyter lab` started there): the same resolution, in ipykernel."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(WHICH_KERNELS)])
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    found = json.loads(nb.cells[0].outputs[0]["text"])
    assert Path(found["kernels"]) == HF_KERNELS / "__init__.py"
    assert Path(found["verify"]).resolve() == ROOT / "kernels" / "verify.py"


def test_every_subpackage_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"minispec." + p.parent.relative_to(ROOT / "minispec").as_posix().replace("/", ".")
             for p in (ROOT / "minispec").rglob("__init__.py") if p.parent != ROOT / "minispec"}
    found |= {"minispec", "minispec.kernels"}  # kernels/ has no __init__.py
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


def layout_map() -> list[str]:
    """The paths CONTRIBUTING.md's layout map names, nested entries under their folder (`minispec/costs/`)."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    paths, parent = [], ""
    for line in block.splitlines():
        if not line.strip() or line.startswith(" " * 6):  # blank, or a description's continuation
            continue
        name = line.split()[0]
        if line.startswith("  "):
            paths.append(parent + name)
        else:
            paths.append(name)
            parent = name if name.endswith("/") else ""
    return paths


def test_the_layout_map_names_only_what_exists_and_every_package_folder():
    paths = layout_map()
    assert len(paths) > 20 and "minispec/costs/" in paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"CONTRIBUTING.md's map names paths that do not exist: {missing}"
    folders = {f"minispec/{p.name}/" for p in (ROOT / "minispec").iterdir()
               if p.is_dir() and not p.is_symlink() and p.name != "__pycache__"}
    assert not folders - set(paths), f"folders of minispec/ the map does not name: {sorted(folders - set(paths))}"


def floors() -> dict[str, int]:
    """CONTRIBUTING.md's floor table: room name -> floor."""
    text = (ROOT / "CONTRIBUTING.md").read_text().split("<!-- floors -->", 1)[1]
    rooms = {}
    for line in text.splitlines()[3:]:
        if not line.startswith("|"):
            break
        floor, names = (cell.strip() for cell in line.strip("|").split("|"))
        for name in names.split(","):
            rooms[name.split()[0].strip("`")] = int(floor)
    return rooms


UPWARD_BY_DESIGN = {("speculative/target.py", "ssm")}  # HF's NemotronH becomes HybridLM for the loops


def room_imports():
    """(file under minispec/, its room, imported room) for every `minispec.*` import, lazy ones included."""
    import ast

    pkg = ROOT / "minispec"
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg)
        if rel.parts[0] in ("kernels", "checkpoints"):
            continue
        room = rel.parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) and node.module and not node.level else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                parts = name.split(".")
                is_room = len(parts) > 1 and ((pkg / parts[1]).is_dir() or (pkg / f"{parts[1]}.py").exists())
                if parts[0] == "minispec" and is_room and parts[1] != room:
                    yield rel.as_posix(), room, parts[1]


def test_every_import_runs_down_the_floors_contributing_names():
    table = floors()
    assert table["backend"] == 0 and table["lessons"] > table["bench"] > table["quant"]
    seen, up = set(), []
    for file, room, imported in room_imports():
        seen |= {room, imported}
        if table[imported] > table[room] and (file, imported) not in UPWARD_BY_DESIGN:
            up.append(f"{file} ({room}, floor {table[room]}) imports {imported} (floor {table[imported]})")
    assert not up, "imports that run up the floors:\n" + "\n".join(up)
    not_code = ("kernels", "checkpoints", "datasets", "__pycache__")
    rooms = {p.name.removesuffix(".py") for p in (ROOT / "minispec").iterdir()
             if p.name not in not_code and (p.suffix == ".py" or p.is_dir())}
    assert rooms == set(table), f"rooms the floor table misses or names wrongly: {sorted(rooms ^ set(table))}"
    assert len(seen) > 15
