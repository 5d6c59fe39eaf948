"""The tree passes the linter configured in pyproject.toml (ruff), notebooks included."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_passes():
    ruff = shutil.which("ruff") or pytest.fail("ruff is not installed: `pip install -e \".[test]\"` installs it")
    out = subprocess.run([ruff, "check", "--no-cache", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_noqa_gives_its_reason():
    """A `noqa` silences the linter; the line must say why (text after the code, e.g. `# noqa: E402 — ...`)."""
    bare = []
    for path in [*ROOT.glob("minispec/**/*.py"), *ROOT.glob("kernels/*.py"), *ROOT.glob("tests/*.py")]:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if "# noqa" in line and not line.split("# noqa", 1)[1].split(None, 1)[1:]:
                bare.append(f"{path.relative_to(ROOT)}:{i}")
    assert not bare, "noqa without a reason: " + ", ".join(bare)
