"""A sha256 manifest beside every shipped checkpoint, checked when the folder is loaded.

`SHA256SUMS` lists the regular files directly in a folder in `sha256sum`'s format, one
"<64 hex digits>  <file name>" line per file, sorted by name, so `sha256sum -c SHA256SUMS` run inside
the folder checks it too. A subfolder is not listed: it is loaded on its own and carries its own
manifest (lightning-mini-post/mtp-heads/boost-nohsm, for one).

Loading checks the manifest (`check_manifest`) wherever a checkpoint folder is read, so a damaged or
half-copied file stops the load with an error that names it, instead of loading silently. A folder
without SHA256SUMS (a user's own model) is not checked. Each file is hashed once per process and
remembered by (path, size, mtime), so loading the same checkpoint again only reads its files' sizes and
times. Hashing all the shipped checkpoints (51 MB) takes about 0.1 s on an idle CPU core (0.55 s measured
on a busy 2-core machine), once per process.

After retraining a shipped checkpoint, rewrite its manifest:

    python -m minispec.manifest minispec/checkpoints/bolt-mini [FOLDER ...]
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

MANIFEST = "SHA256SUMS"
WEIGHT_SUFFIXES = (".safetensors", ".json")  # what a load reads: a file of these kinds must be listed
RECORDS = ("training.json", "mtp_training.json", "evalset.json")  # where build commands record themselves
LINE = re.compile(r"([0-9a-f]{64}) [ *](.+)")  # sha256sum's format; " *" marks binary mode

_digests: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256 hex digest


class CorruptCheckpointError(ValueError):
    """A checkpoint folder does not match its SHA256SUMS: a file changed, is missing, or is not listed."""


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of a file, remembered per (path, size, mtime) for the life of the process."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _digests:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        _digests[key] = digest.hexdigest()
    return _digests[key]


def write_manifest(folder: Path) -> None:
    """(Re)write folder/SHA256SUMS for the regular files directly in `folder` (not SHA256SUMS itself)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise NotADirectoryError(f"cannot write a manifest for {folder}: not a folder")
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)
    if not names:
        raise ValueError(f"{folder} holds no files to list in a manifest")
    odd = [name for name in names if "\n" in name or "\\" in name]
    if odd:
        raise ValueError(f"{folder}: file names with a newline or a backslash cannot be listed in {MANIFEST}: {odd}")
    (folder / MANIFEST).write_text("".join(f"{file_sha256(folder / name)}  {name}\n" for name in names))


def read_manifest(folder: Path) -> dict[str, str]:
    """folder/SHA256SUMS as {file name: sha256 hex digest}."""
    listed = {}
    for number, line in enumerate((folder / MANIFEST).read_text().splitlines(), start=1):
        match = LINE.fullmatch(line)
        name = match and match.group(2)
        if not match or "/" in name or name in (".", "..", MANIFEST):
            raise CorruptCheckpointError(f"{folder / MANIFEST} line {number} is not '<sha256>  <file name>' for a "
                                         f"file in its folder: {line!r}. {_remedy(folder, None)}")
        listed[name] = match.group(1)
    return listed


def recorded_command(folder: Path) -> str | None:
    """The command that built `folder`, as its build record says (earlier stages first), or None."""
    for name in RECORDS:
        try:
            record = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        commands = []
        while isinstance(record, dict) and isinstance(record.get("command"), str):
            commands.insert(0, record["command"])
            record = record.get("previous_stage")
        if commands:
            return ", then ".join(commands)
    return None


def check_manifest(folder: Path, rebuild: str | None = None) -> None:
    """Raise CorruptCheckpointError unless `folder` matches its SHA256SUMS; a folder without one is not checked.

    Every listed file must exist and have the listed digest, and every *.safetensors or *.json file in
    the folder must be listed. rebuild: the command that rebuilds the folder, for the error message
    (default: the command recorded in the folder's build record).
    """
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        return
    listed = read_manifest(folder)
    for name, expected in listed.items():
        path = folder / name
        if not path.is_file():
            problem = f"{path} is missing, but {MANIFEST} lists it"
        elif (actual := file_sha256(path)) != expected:
            problem = (f"{path} does not match {MANIFEST} (sha256 {actual[:12]}…, expected {expected[:12]}…): the "
                       "file is damaged or was changed after the manifest was written")
        else:
            continue
        raise CorruptCheckpointError(f"{problem}. {_remedy(folder, rebuild)}")
    unlisted = sorted(p.name for p in folder.iterdir()
                      if p.is_file() and p.suffix in WEIGHT_SUFFIXES and p.name not in listed)
    if unlisted:
        raise CorruptCheckpointError(f"{folder} holds {', '.join(unlisted)}, which {MANIFEST} does not list. "
                                     f"{_remedy(folder, rebuild)}")


def _remedy(folder: Path, rebuild: str | None) -> str:
    command = rebuild or recorded_command(folder)
    how = f"rebuild it with `{command}`" if command else "rebuild it with the command that built it"
    return (f"To repair {folder}: {how} and rewrite the manifest with `python -m minispec.manifest "
            f"{folder}`, or, for a checkpoint shipped with minispec, reinstall minispec.")


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m minispec.manifest",
                                description="(Re)write SHA256SUMS in each checkpoint folder, e.g. after retraining.")
    p.add_argument("folders", nargs="+", type=Path, metavar="FOLDER")
    folders = p.parse_args(argv).folders
    not_folders = [str(f) for f in folders if not f.is_dir()]
    if not_folders:
        p.error(f"not a folder: {', '.join(not_folders)}")
    for folder in folders:
        write_manifest(folder)
        print(f"wrote {folder / MANIFEST} ({len(read_manifest(folder))} files)")


if __name__ == "__main__":
    main()
