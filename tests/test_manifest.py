"""SHA256SUMS beside every shipped checkpoint: each shipped folder has one and matches it, and loading a
folder that does not match (a flipped byte, a missing file, an unlisted weight file) stops with an error
naming the file and how to rebuild it."""
import shutil
import subprocess
from pathlib import Path

import pytest

import minispec as ms
from minispec import manifest
from minispec.manifest import MANIFEST, CorruptCheckpointError, check_manifest, read_manifest, write_manifest
from minispec.mtp.head import MTPHead
from minispec.targets.load import CHECKPOINTS

SHIPPED = sorted({p.parent for p in CHECKPOINTS.rglob("*") if p.is_file()})


def copy_of(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(CHECKPOINTS / name, tmp_path / Path(name).name))


def flip_a_byte(path: Path, offset: int = 1000) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_shipped_folders_are_the_ones_expected():
    names = {str(folder.relative_to(CHECKPOINTS)) for folder in SHIPPED}
    assert {"bolt-mini", "bolt-nano", "bolt-mini-dflash", "lightning-mini", "lightning-mini-post", "tokenizer",
            "evalset", "smollm2-135m-dflash", "lightning-mini-post/mtp-heads/boost-nohsm"} <= names


@pytest.mark.parametrize("folder", SHIPPED, ids=lambda f: str(f.relative_to(CHECKPOINTS)))
def test_every_shipped_folder_lists_each_of_its_files_and_matches(folder):
    # A retrained checkpoint whose manifest was not rewritten fails here:
    # python -m minispec.manifest minispec/checkpoints/<name>
    files = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)
    assert sorted(read_manifest(folder)) == files
    check_manifest(folder)


def test_the_manifest_is_in_sha256sum_format(tmp_path):
    folder = copy_of("bolt-mini-dflash", tmp_path)
    lines = (folder / MANIFEST).read_text().splitlines(keepends=True)
    names = [line.split("  ", 1)[1] for line in lines]
    assert names == sorted(names) and all(len(line.split("  ")[0]) == 64 and line.endswith("\n") for line in lines)
    if shutil.which("sha256sum") is None:
        pytest.skip("no sha256sum here")
    assert subprocess.run(["sha256sum", "--strict", "--quiet", "-c", MANIFEST], cwd=folder).returncode == 0
    flip_a_byte(folder / "model.safetensors")
    assert subprocess.run(["sha256sum", "--quiet", "-c", MANIFEST], cwd=folder, capture_output=True).returncode != 0


def test_write_manifest_lists_the_files_of_the_folder_itself_not_its_subfolders(tmp_path):
    folder = copy_of("lightning-mini-post", tmp_path)
    write_manifest(folder)
    listed = read_manifest(folder)
    assert "mtp-heads" not in listed and MANIFEST not in listed and "model.safetensors" in listed
    assert (folder / MANIFEST).read_text() == (CHECKPOINTS / "lightning-mini-post" / MANIFEST).read_text()
    assert (folder / "mtp-heads" / "boost-nohsm" / MANIFEST).exists()  # the subfolder keeps its own


def test_load_target_refuses_a_flipped_byte_naming_the_file_and_the_rebuild(tmp_path):
    folder = copy_of("bolt-mini", tmp_path)
    flip_a_byte(folder / "model.safetensors")
    with pytest.raises(CorruptCheckpointError) as error:
        ms.load_target(folder)
    message = str(error.value)
    assert str(folder / "model.safetensors") in message and "does not match SHA256SUMS" in message
    assert "python -m minispec.targets.train bolt-mini" in message and "reinstall minispec" in message
    assert f"python -m minispec.manifest {folder}" in message


def test_load_drafter_refuses_a_flipped_byte_in_a_dflash_drafter(tmp_path):
    target, _ = ms.load_target("bolt-mini")
    folder = copy_of("bolt-mini-dflash", tmp_path)
    flip_a_byte(folder / "model.safetensors")
    with pytest.raises(CorruptCheckpointError, match="model.safetensors does not match SHA256SUMS"):
        ms.load_drafter(folder, target)


def test_an_mtp_head_with_a_flipped_byte_is_refused(tmp_path):
    folder = copy_of("lightning-mini-post/mtp-heads/boost-nohsm", tmp_path)
    flip_a_byte(folder / "mtp.safetensors")
    with pytest.raises(CorruptCheckpointError, match="mtp.safetensors does not match") as error:
        MTPHead.from_pretrained(folder)
    assert "python -m minispec.mtp.stages boost" in str(error.value)  # from its mtp_training.json


def test_a_missing_listed_file_is_named(tmp_path):
    folder = copy_of("bolt-nano", tmp_path)
    (folder / "generation_config.json").unlink()
    with pytest.raises(CorruptCheckpointError, match="generation_config.json is missing, but SHA256SUMS lists it"):
        check_manifest(folder)


def test_an_unlisted_weight_file_is_named(tmp_path):
    folder = copy_of("bolt-mini-dflash", tmp_path)
    shutil.copy(folder / "model.safetensors", folder / "model-00002.safetensors")
    with pytest.raises(CorruptCheckpointError, match="holds model-00002.safetensors, which SHA256SUMS does not list"):
        check_manifest(folder)
    (folder / "model-00002.safetensors").unlink()
    (folder / "NOTES.txt").write_text("not a weight file: not checked")
    check_manifest(folder)


def test_a_malformed_manifest_line_is_named(tmp_path):
    folder = copy_of("tokenizer", tmp_path)
    (folder / MANIFEST).write_text("0123  tokenizer.json\n")
    with pytest.raises(CorruptCheckpointError, match="line 1 is not"):
        check_manifest(folder)


def test_a_folder_without_a_manifest_is_not_checked(tmp_path):
    folder = copy_of("bolt-mini-dflash", tmp_path)
    (folder / MANIFEST).unlink()
    flip_a_byte(folder / "model.safetensors", offset=len((folder / "model.safetensors").read_bytes()) - 1)
    check_manifest(folder)


def test_each_file_is_hashed_once_until_it_changes(tmp_path, monkeypatch):
    import hashlib
    import os

    folder = copy_of("bolt-mini-dflash", tmp_path)
    hashed, sha256 = [], hashlib.sha256

    def counting_sha256(*args):
        hashed.append(1)
        return sha256(*args)

    monkeypatch.setattr(manifest.hashlib, "sha256", counting_sha256)
    check_manifest(folder)
    assert len(hashed) == 3
    check_manifest(folder)
    assert len(hashed) == 3  # remembered by (path, size, mtime)
    path = folder / "model.safetensors"
    mtime = path.stat().st_mtime_ns
    flip_a_byte(path)
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))  # a rewrite gets a new mtime
    with pytest.raises(CorruptCheckpointError):
        check_manifest(folder)
    assert len(hashed) == 4


def test_the_command_line_rewrites_manifests_and_refuses_a_non_folder(tmp_path, capsys):
    folder = copy_of("bolt-mini-dflash", tmp_path)
    (folder / "extra.json").write_text("{}")
    manifest.main([str(folder)])
    assert "extra.json" in read_manifest(folder) and "(4 files)" in capsys.readouterr().out
    check_manifest(folder)
    with pytest.raises(SystemExit):
        manifest.main([str(folder / "config.json")])
    assert "not a folder" in capsys.readouterr().err


def test_the_package_data_glob_ships_the_manifests():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["minispec"]
    package = CHECKPOINTS.parent
    shipped = {p for pattern in globs for p in package.glob(pattern) if p.is_file()}
    assert {folder / MANIFEST for folder in SHIPPED} <= shipped
