"""Write lock.txt: the exact version of every package that the README's install commands bring in.

    python tools/lock.py            # resolve afresh and rewrite lock.txt
    python tools/lock.py --check    # exit 1 if lock.txt is not what pyproject.toml resolves to today

pip resolves `minispec[notebooks,test]` (the union of the README's three commands) in a throwaway
virtual environment, so nothing installed here leaks into the answer, and `pip install --dry-run
--report` writes what it would install without installing it. Every README command passes the lock as
constraints (`-c lock.txt`): a constraint fixes the version of a package that is installed anyway and
adds nothing, so one file serves all three commands and the CPU and CUDA builds of torch alike
(`torch==2.14.1` admits `2.14.1+cpu`). The two data packages that the README installs with `--no-deps`
are pinned in the README commands themselves: they are content (model weights, questions), not code.

The lock is for the platform it was resolved on (its header says which: Linux x86-64, CPython 3.11
here). Refresh it when an upstream release should come in, and land the refresh only with the suite
green on it; `tools/newest.sh` runs the suite on the newest releases without the lock.
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "lock.txt"
EXTRAS = "notebooks,test"


def resolve() -> dict[str, str]:
    """{distribution name: version} that `pip install -e .[EXTRAS]` would install into an empty venv."""
    with tempfile.TemporaryDirectory() as tmp:
        venv.create(tmp, with_pip=True)
        python = Path(tmp) / "bin" / "python"
        report = Path(tmp) / "report.json"
        for args in (["--upgrade", "pip"], ["--dry-run", "--ignore-installed", "--report", report,
                                             "-e", f"{ROOT}[{EXTRAS}]"]):
            done = subprocess.run([python, "-m", "pip", "install", "--quiet", *args], capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"pip install {' '.join(map(str, args))} failed:\n{done.stderr[-3000:]}")
        items = json.loads(report.read_text())["install"]
    pins = {re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower(): item["metadata"]["version"] for item in items}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    pins.pop(project)
    return pins


def render(pins: dict[str, str]) -> str:
    header = [
        "# The exact versions the README's install commands are tested with. Written by tools/lock.py",
        f"# from pyproject.toml ([{EXTRAS}]); do not edit by hand.",
        f"# Resolved on {platform.system()} {platform.machine()}, CPython {platform.python_version()}.",
    ]
    return "\n".join([*header, *(f"{name}=={version}" for name, version in sorted(pins.items()))]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/lock.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare with lock.txt instead of writing it")
    args = p.parse_args(argv)
    text = render(resolve())
    if args.check:
        if LOCK.read_text().splitlines()[3:] != text.splitlines()[3:]:
            print("lock.txt differs from what pyproject.toml resolves to today: python tools/lock.py", file=sys.stderr)
            return 1
        print("lock.txt is current")
        return 0
    LOCK.write_text(text)
    print(f"wrote {LOCK.relative_to(ROOT)}: {text.count('==')} pins")
    return 0


if __name__ == "__main__":
    sys.exit(main())
