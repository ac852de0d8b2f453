"""DiskCache: a byte-bounded, least-recently-used cache of files shared by processes."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import multiprocessing
import os
import random
import time
import warnings

import pytest

from octfw.recipe.fields import parse_bytes
from octfw.storage import disk_cache
from octfw.storage.disk_cache import DiskCache


def blob(key: str) -> bytes:
    """The one value ever stored under ``key`` in these tests: 50 to 400 bytes derived from it."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * 13)[: 50 + seed[0] * 350 // 255]


def files_in(folder) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.is_file())


def counted(folder) -> int:
    return int((folder / disk_cache.USAGE_FILE).read_bytes())


def test_put_then_get_returns_the_bytes_and_a_missing_key_none(tmp_path):
    cache = DiskCache(tmp_path, 10**6)
    cache.put("abc123", b"hello")
    assert cache.path("abc123") == tmp_path / "ab" / "abc123"
    assert cache.path("abc123").read_bytes() == b"hello"
    assert cache.get("abc123") == b"hello"
    assert cache.get("ffff") is None
    assert cache.total_bytes() == 5


@pytest.mark.parametrize("key", ["", ".usage", ".tmp-x", "a/b", "..", "a\0b"])
def test_a_key_that_is_not_a_plain_file_name_is_refused(tmp_path, key):
    with pytest.raises(ValueError, match="cache key"):
        DiskCache(tmp_path, 100).put(key, b"x")


def test_the_least_recently_used_entry_goes_first_and_a_read_one_stays(tmp_path):
    cache = DiskCache(tmp_path, 300)
    for key in ("aa", "bb", "cc"):
        cache.put(key, key.encode() * 50)  # 100 bytes each: the cache is full
    assert cache.get("aa") is not None  # now more recently used than bb and cc
    cache.put("dd", b"d" * 100)
    assert cache.get("bb") is None, "the oldest entry is evicted"
    assert [cache.get(k) is not None for k in ("aa", "cc", "dd")] == [True, True, True]
    cache.put("ee", b"e" * 150)  # needs two entries' room: cc (oldest), then aa
    assert [cache.get(k) is not None for k in ("aa", "cc", "dd", "ee")] == [False, False, True, True]
    assert cache.total_bytes() == 250 == counted(tmp_path)


def test_the_bound_holds_after_every_one_of_many_puts(tmp_path):
    cache = DiskCache(tmp_path, 2000)
    rng = random.Random(0)
    for i in range(300):
        key = f"k{rng.randrange(60):02d}"
        cache.put(key, blob(key))
        assert cache.total_bytes() <= 2000
        assert cache.get(key) == blob(key), "the entry just stored is the newest, never evicted by its own put"
    assert cache.total_bytes() == counted(tmp_path)
    assert cache.total_bytes() > 2000 - 400  # evicted no more than room for the next entry


def test_a_put_far_below_the_bound_does_not_scan_the_folder(tmp_path, monkeypatch):
    scans = []
    scan = DiskCache._scan
    monkeypatch.setattr(DiskCache, "_scan", lambda self: scans.append(1) or scan(self))
    cache = DiskCache(tmp_path, 10**6)
    for i in range(50):
        cache.put(f"k{i:02d}", b"x" * 100)
    assert len(scans) == 1, "one scan to start the shared count"
    other = DiskCache(tmp_path, 10**6)  # another process (or run) on the same folder
    for i in range(50, 100):
        other.put(f"k{i:02d}", b"x" * 100)
    assert len(scans) == 1 and counted(tmp_path) == 100 * 100
    small = DiskCache(tmp_path, 100 * 100)
    small.put("knew", b"x" * 100)  # crosses the bound: one scan evicts
    assert len(scans) == 2 and small.total_bytes() == 100 * 100


def test_replacing_an_entry_counts_its_bytes_once(tmp_path):
    cache = DiskCache(tmp_path, 250)
    cache.put("aa", b"1" * 100)
    cache.put("aa", b"2" * 100)
    assert counted(tmp_path) == 100
    cache.put("bb", b"3" * 100)  # fits beside aa's single copy
    assert cache.get("aa") == b"2" * 100 and cache.get("bb") == b"3" * 100


def test_a_damaged_or_missing_count_is_rebuilt_by_a_scan(tmp_path):
    cache = DiskCache(tmp_path, 1000)
    cache.put("aa", b"a" * 300)
    (tmp_path / disk_cache.USAGE_FILE).write_bytes(b"garbage")
    cache.put("bb", b"b" * 300)
    assert counted(tmp_path) == 600
    (tmp_path / disk_cache.USAGE_FILE).unlink()
    cache.put("cc", b"c" * 300)
    assert counted(tmp_path) == 900


def test_max_bytes_0_turns_the_cache_off(tmp_path):
    cache = DiskCache(tmp_path / "cache", 0)
    cache.put("aa", b"data")
    cache.put("bb", b"")
    assert cache.get("aa") is None and cache.get("bb") is None
    assert not (tmp_path / "cache").exists()


def test_an_entry_larger_than_the_bound_is_not_stored_and_evicts_nothing(tmp_path):
    cache = DiskCache(tmp_path, 100)
    cache.put("aa", b"a" * 60)
    cache.put("bb", b"b" * 101)
    assert cache.get("bb") is None and cache.get("aa") == b"a" * 60
    assert files_in(tmp_path) == [".usage", "aa"]


def test_an_unbounded_cache_keeps_everything_and_counts_nothing(tmp_path):
    cache = DiskCache(tmp_path, None)
    for i in range(20):
        cache.put(f"k{i:02d}", b"x" * 1000)
    assert cache.total_bytes() == 20_000
    assert not (tmp_path / disk_cache.USAGE_FILE).exists()


def test_a_negative_bound_is_refused(tmp_path):
    with pytest.raises(ValueError, match="max_bytes"):
        DiskCache(tmp_path, -1)


def test_writes_leave_no_temporary_file_and_a_failed_one_keeps_the_old_entry(tmp_path, monkeypatch, caplog):
    cache = DiskCache(tmp_path, 10**6)
    for i in range(10):
        cache.put(f"k{i:02d}", blob(f"k{i:02d}"))
    assert not [name for name in files_in(tmp_path) if name.startswith(".tmp-")]

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_cache.os, "replace", disk_full)
    with caplog.at_level(logging.WARNING, logger="octfw"):
        cache.put("k00", b"new bytes")
    assert "No space left on device" in caplog.text
    assert cache.get("k00") == blob("k00"), "a reader sees the old entry whole"
    assert not [name for name in files_in(tmp_path) if name.startswith(".tmp-")]


def test_temporary_files_are_not_entries_and_a_stale_one_is_removed(tmp_path):
    cache = DiskCache(tmp_path, 10**6)
    cache.put("aa", b"a" * 10)
    young, stale = tmp_path / "aa" / ".tmp-young", tmp_path / "aa" / ".tmp-stale"
    young.write_bytes(b"being written")
    stale.write_bytes(b"left by a killed writer")
    hours_ago = time.time_ns() - 2 * disk_cache.STALE_TEMP_NS
    os.utime(stale, ns=(hours_ago, hours_ago))
    assert cache.total_bytes() == 10
    assert young.exists() and not stale.exists()


def test_a_cache_that_cannot_be_written_warns_once_and_does_not_raise(tmp_path, caplog):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")
    cache = DiskCache(blocker, 10**6)
    with caplog.at_level(logging.WARNING, logger="octfw"):
        for i in range(5):
            cache.put(f"k{i:02d}", b"x")
    assert len([r for r in caplog.records if "cannot write to the cache" in r.getMessage()]) == 1
    assert cache.get("k00") is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_warns_once_and_still_serves_hits(tmp_path):
    cache = DiskCache(tmp_path / "cache", 10**6)
    cache.put("aa", b"kept")
    for folder in (tmp_path / "cache", tmp_path / "cache" / "aa"):
        folder.chmod(0o555)
    try:
        with pytest.warns(RuntimeWarning, match="cannot write to the cache") as caught:
            cache.put("bb", b"x")
            cache.put("aa", b"y")
        assert len(caught) == 1
        assert cache.get("aa") == b"kept" and cache.get("bb") is None
    finally:
        for folder in (tmp_path / "cache", tmp_path / "cache" / "aa"):
            folder.chmod(0o755)


BOUND = 3000  # room for about a dozen of the 50-400 byte blobs


def _churn(folder: str, seed: int, rounds: int) -> None:
    """One process: put and get random keys; exit 1 if a get ever returns other bytes."""
    cache = DiskCache(folder, BOUND)
    rng = random.Random(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning (a failed write) fails the process
        for _ in range(rounds):
            key = f"k{rng.randrange(40):02d}"
            got = cache.get(key)
            if got is not None and got != blob(key):
                os._exit(1)
            cache.put(key, blob(key))
    os._exit(0)


def test_concurrent_processes_share_one_bound_and_never_read_half_an_entry(tmp_path):
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_churn, args=(str(tmp_path), seed, 400)) for seed in range(3)]
    for worker in workers:
        worker.start()
    reader = DiskCache(tmp_path, BOUND)
    reads = snapshots = 0
    while any(w.is_alive() for w in workers):
        for i in range(40):
            got = reader.get(f"k{i:02d}")
            assert got is None or got == blob(f"k{i:02d}")
            reads += got is not None
        # Under the cache's own lock no put renames or evicts: a consistent snapshot, within
        # the bound at every moment, the fill of the empty folder included.
        with open(tmp_path / disk_cache.USAGE_FILE, "a+b") as usage:
            fcntl.flock(usage, fcntl.LOCK_EX)
            assert reader.total_bytes() <= BOUND
            snapshots += 1
    for worker in workers:
        worker.join()
        assert worker.exitcode == 0
    assert reads and snapshots
    # At rest (no write in flight) the entries are within the bound and the shared count exact.
    assert reader.total_bytes() <= BOUND
    assert reader.total_bytes() == counted(tmp_path)
    assert not [name for name in files_in(tmp_path) if name.startswith(".tmp-")]


@pytest.mark.parametrize("text, size", [("20GiB", 20 * 1024**3), ("500MB", 500 * 10**6), ("0", 0),
                                         (0, 0), (1024, 1024), (" 1.5 kib ", 1536)])
def test_sizes_read_as_bytes(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("value", ["lots", "", "-1GB", "20 parsecs", -1, True, 1.5, None])
def test_what_is_not_a_size_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=f"^{value!r} is not a size in bytes"):
        parse_bytes(value)
