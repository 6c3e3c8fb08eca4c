"""``cache_dir.folder_written_once``: a cache folder appears whole or not at all, and its temporary
folder never outlives the write."""

from __future__ import annotations

import pytest

from pagedllm.cache_dir import folder_written_once


def test_a_clean_write_becomes_the_folder(tmp_path):
    target = tmp_path / "cache" / "key"
    with folder_written_once(target) as tmp:
        assert tmp.parent == target.parent and tmp.is_dir() and not target.exists()
        (tmp / "weights").write_text("w")
    assert (target / "weights").read_text() == "w"
    assert [p.name for p in target.parent.iterdir()] == ["key"]


def test_a_failed_write_leaves_nothing(tmp_path):
    target = tmp_path / "key"
    with pytest.raises(OSError, match="No space left"), folder_written_once(target) as tmp:
        (tmp / "half").write_text("x")
        raise OSError(28, "No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_another_processs_folder_made_meanwhile_stays_and_ours_is_dropped(tmp_path):
    target = tmp_path / "key"
    with folder_written_once(target) as tmp:
        (tmp / "weights").write_text("ours")
        target.mkdir()  # another process finished first
        (target / "weights").write_text("theirs")
    assert (target / "weights").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["key"]


def test_losing_the_race_between_the_check_and_the_rename_is_not_an_error(tmp_path, monkeypatch):
    """Both processes saw no folder; the other one renamed first, so ours fails to rename onto it."""
    from pathlib import Path

    target = tmp_path / "key"
    rename = Path.replace

    def other_process_first(self, dest):
        Path(dest).mkdir()
        (Path(dest) / "weights").write_text("theirs")
        return rename(self, dest)  # onto a non-empty folder: OSError (ENOTEMPTY)

    with folder_written_once(target) as tmp:
        (tmp / "weights").write_text("ours")
        monkeypatch.setattr(Path, "replace", other_process_first)
    assert (target / "weights").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["key"]
