#!/usr/bin/env bash
# The suite on the newest releases, without the lock: a fresh clone of this checkout, a fresh venv, the
# README's test command with `-c lock.txt` taken out, then the versions that came in beside the locked ones.
#   bash tools/newest.sh [WORK_DIR]      (default: a temporary folder, removed afterwards)
# Run it before refreshing lock.txt (python tools/lock.py): a green run here is what a refresh lands on.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-$(mktemp -d)}"
[ -n "${1:-}" ] || trap 'rm -rf "$work"' EXIT

git clone --quiet "$root" "$work/minispec"
cd "$work/minispec"
python3 -m venv .venv
source .venv/bin/activate
python -m pip install --quiet --upgrade pip

cmd=$(awk '/<!-- test-command -->/{f=1; next} f && /^```/{if (g) exit; g=1; next} g{print; exit}' README.md)
unlocked=${cmd//-c lock.txt /}
[ "$unlocked" != "$cmd" ] || { echo "the README's test command does not use -c lock.txt" >&2; exit 1; }
echo "+ $unlocked"
set +e
bash -c "$unlocked"
rc=$?
set -e

python - <<'PY'
import re
from importlib.metadata import distributions

norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
lock = dict(line.strip().split("==") for line in open("lock.txt") if "==" in line and not line.startswith("#"))
newer = sorted(f"{norm(d.metadata['Name'])} {lock.get(norm(d.metadata['Name']), '(not locked)')} -> {d.version}"
               for d in distributions() if lock.get(norm(d.metadata["Name"])) != d.version
               and norm(d.metadata["Name"]) != "minispec")
print("installed here, other than lock.txt:", *(newer or ["(none)"]), sep="\n  ")
PY
exit "$rc"
