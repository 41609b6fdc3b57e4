"""One writer per run directory, and the staging a killed writer leaves."""

from __future__ import annotations

import threading
import time

import pytest

from realtime_rl.model.checkpoint import publish_directory
from realtime_rl.train.run_dir import remove_staging, run_dir_lock


def test_a_held_run_dir_is_refused_at_once_or_after_the_wait(tmp_path):
    with run_dir_lock(tmp_path, "`rtrl pretrain`"):
        with pytest.raises(ValueError, match="in use by another `rtrl pretrain`"):
            with run_dir_lock(tmp_path, "`rtrl pretrain`"):
                pass
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="waited 0.3 s"):
            with run_dir_lock(tmp_path, "`rtrl pretrain`", wait_s=0.3):
                pass
        assert time.monotonic() - t0 >= 0.3
    with run_dir_lock(tmp_path, "`rtrl pretrain`"):  # released with the block
        pass


def test_a_waiting_holder_gets_the_run_dir_when_it_is_released(tmp_path):
    held, order = threading.Event(), []

    def first():
        with run_dir_lock(tmp_path, "x"):
            held.set()
            time.sleep(0.3)
            order.append("first done")

    thread = threading.Thread(target=first)
    thread.start()
    held.wait(5)
    with run_dir_lock(tmp_path, "x", wait_s=10):
        order.append("second in")
    thread.join(5)
    assert order == ["first done", "second in"]


def test_staging_is_removed_and_a_directory_moved_aside_is_put_back(tmp_path):
    published = tmp_path / "checkpoints"
    for name, text in (("v-0000001", "one"), ("v-0000002", "two")):
        staging = tmp_path / f".ckpt-{name}"
        staging.mkdir()
        (staging / "weights").write_text(text)
        publish_directory(staging, published / name)
    # A kill between publish_directory's two renames: v-0000002 moved aside, its replacement still staged.
    aside = published / ".old-v-0000002-abc"
    aside.mkdir()
    (published / "v-0000002").rename(aside / "v-0000002")
    (tmp_path / ".ckpt-new").mkdir()
    (tmp_path / ".ckpt-new" / "weights").write_text("two, saved again")
    (tmp_path / ".corpus-half").mkdir()
    # A kill after both renames, before the old copy was removed: the name holds the new one.
    stale_old = published / ".old-v-0000001-def"
    (stale_old / "v-0000001").mkdir(parents=True)
    (stale_old / "v-0000001" / "weights").write_text("one, before")

    removed = remove_staging(tmp_path)
    assert (published / "v-0000002" / "weights").read_text() == "two"
    assert (published / "v-0000001" / "weights").read_text() == "one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]
    assert sorted(p.name for p in published.iterdir()) == ["v-0000001", "v-0000002"]
    assert len(removed) == 4


def test_a_directory_moved_aside_by_the_older_publisher_is_put_back_too(tmp_path):
    """Before 1235a1f publish_directory moved the old directory aside into run_dir, not beside it."""
    published = tmp_path / "checkpoints"
    published.mkdir()
    legacy = tmp_path / ".old-v-0000003-xyz" / "v-0000003"
    legacy.mkdir(parents=True)
    (legacy / "weights").write_text("three")
    remove_staging(tmp_path)
    assert (published / "v-0000003" / "weights").read_text() == "three"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]
