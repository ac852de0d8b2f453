"""The prepared-volume cache and balanced domain sampling in the data pipeline."""

from __future__ import annotations

import collections
import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from octfw.dicom.dataset import DicomDataset
from octfw.plugins.transforms.oct_standard import OCTStandardConfig, build
from octfw.plugins.transforms.oct_standard.cache import PreparedCache
from octfw.plugins.datasets.synthetic.cohort import write_synthetic_cohort
from octfw.engine.data import SampleSource, make_loader
from octfw.engine.domains import domain_report
from octfw.engine.sampling import BalancedEpochOrder, EpochOrder
from octfw.types import BuildContext, PreparingTransform, SourcedDataset

IMAGE = (4, 16, 16)
SHAPES = {"heidelberg": (4, 20, 12), "topcon": (3, 16, 16), "zeiss": (5, 14, 10)}


def make_transform(cache_dir: Path, **options):
    ctx = BuildContext(recipe_dir=cache_dir, cache_dir=cache_dir, run_dir=None, seed=0,
                       image_size=IMAGE, patch_size=(2, 8, 8))
    return build(OCTStandardConfig(image_size=IMAGE, **options), ctx)


class CountingDataset:
    """Wraps a dataset and counts ``load`` calls (files actually read)."""

    def __init__(self, inner):
        self.inner, self.loads = inner, collections.Counter()

    def __len__(self):
        return len(self.inner)

    def load(self, index):
        self.loads[index] += 1
        return self.inner.load(index)

    def domain(self, index):
        return self.inner.domain(index)

    def source(self, index):
        return self.inner.source(index)

    def label(self, index):
        return self.inner.label(index)


@pytest.fixture
def cohort(tmp_path) -> DicomDataset:
    write_synthetic_cohort(tmp_path / "cohort", 6, shapes=SHAPES, seed=5, with_labels=True)
    return DicomDataset.from_location(tmp_path / "cohort" / "manifest.jsonl")


def epoch(source: SampleSource, number: int) -> list[dict]:
    return [source[(number, i)] for i in range(len(source))]


def test_the_pipeline_uses_the_cache_of_a_preparing_transform_and_a_sourced_dataset(cohort, tmp_path):
    transform = make_transform(tmp_path / "cache")
    assert isinstance(transform, PreparingTransform) and isinstance(cohort, SourcedDataset)
    assert SampleSource(cohort, transform, seed=0).cache is transform.cache
    assert transform.cache.folder == tmp_path / "cache" / "prepared"
    assert transform.cache.options == transform.cache_key()
    assert transform.cache.files.max_bytes == 20 * 1024**3  # the default bound, "20GiB"


def test_a_cached_epoch_reads_no_file_and_gives_the_same_arrays_and_provenance(cohort, tmp_path):
    dataset = CountingDataset(cohort)
    cached = SampleSource(dataset, make_transform(tmp_path / "cache"), seed=0)
    plain = SampleSource(cohort, make_transform(tmp_path / "other", cache=False), seed=0)
    first = epoch(cached, 0)
    assert sum(dataset.loads.values()) == len(cohort)

    again = epoch(cached, 0)  # the same (epoch, index) keys, now from the cache
    assert sum(dataset.loads.values()) == len(cohort), "a cache hit must not read the file"
    reference = epoch(plain, 0)
    for hit, miss, ref in zip(again, first, reference):
        assert hit["provenance"] == miss["provenance"] == ref["provenance"]
        for key, value in ref["arrays"].items():
            np.testing.assert_array_equal(hit["arrays"][key], value)
            np.testing.assert_array_equal(miss["arrays"][key], value)
    assert {item["provenance"].label for item in again} <= {0, 1}

    # A later epoch draws new views and masks from the same prepared volumes.
    later = epoch(cached, 1)
    assert sum(dataset.loads.values()) == len(cohort)
    assert any(not np.array_equal(a["arrays"]["target_idx"], b["arrays"]["target_idx"])
               for a, b in zip(later, again))


def test_a_new_run_reuses_the_cache_written_by_an_earlier_one(cohort, tmp_path):
    epoch(SampleSource(cohort, make_transform(tmp_path / "cache"), seed=0), 0)
    dataset = CountingDataset(cohort)
    epoch(SampleSource(dataset, make_transform(tmp_path / "cache"), seed=0), 0)
    assert sum(dataset.loads.values()) == 0


@pytest.mark.parametrize("option", [
    {"image_size": (4, 16, 32)},
    {"target_spacing": (0.3, 0.03, 0.08)},
    {"percentiles": (0.5, 99.5)},
    {"fit": "crop_pad"},
    {"anti_aliasing": False},
])
def test_a_changed_preparation_option_never_reuses_entries(cohort, tmp_path, option):
    epoch(SampleSource(cohort, make_transform(tmp_path / "cache"), seed=0), 0)
    config = OCTStandardConfig(**{"image_size": IMAGE, **option})
    ctx = BuildContext(recipe_dir=tmp_path, cache_dir=tmp_path / "cache", run_dir=None, seed=0,
                       image_size=config.image_size, patch_size=(2, 8, 8))
    changed = build(config, ctx)
    assert changed.cache_key() != make_transform(tmp_path / "cache").cache_key()
    dataset = CountingDataset(cohort)
    epoch(SampleSource(dataset, changed, seed=0), 0)
    assert sum(dataset.loads.values()) == len(cohort)


def test_augmentation_options_share_the_cache(cohort, tmp_path):
    epoch(SampleSource(cohort, make_transform(tmp_path / "cache"), seed=0), 0)
    dataset = CountingDataset(cohort)
    augmented = make_transform(tmp_path / "cache", flip_prob=0.5, intensity_jitter=0.1)
    epoch(SampleSource(dataset, augmented, seed=0), 0)
    assert sum(dataset.loads.values()) == 0


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "wrong-shape"])
def test_a_damaged_entry_is_recomputed_and_rewritten(cohort, tmp_path, damage):
    transform = make_transform(tmp_path / "cache")
    reference = epoch(SampleSource(cohort, transform, seed=0), 0)
    path = transform.cache.path(cohort.source(0))
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        PreparedCache(transform.cache.folder, (2, 2, 2), None, transform.cache_key()).put(
            cohort.source(0), np.zeros((2, 2, 2), np.float32), reference[0]["provenance"])
    dataset = CountingDataset(cohort)
    again = epoch(SampleSource(dataset, make_transform(tmp_path / "cache"), seed=0), 0)
    assert dataset.loads == {0: 1}
    np.testing.assert_array_equal(again[0]["arrays"]["context"], reference[0]["arrays"]["context"])
    assert transform.cache.get(cohort.source(0)) is not None


def test_a_local_file_rewritten_in_place_is_prepared_again(tmp_path):
    folder = tmp_path / "cohort"
    write_synthetic_cohort(folder, 3, shapes=SHAPES, seed=1)
    dataset = DicomDataset.from_location(folder / "manifest.jsonl")
    transform = make_transform(tmp_path / "cache")
    before = epoch(SampleSource(dataset, transform, seed=0), 0)
    time.sleep(0.01)  # a distinct modification time
    write_synthetic_cohort(folder, 3, shapes=SHAPES, seed=2)  # new pixels at the same URLs
    counting = CountingDataset(DicomDataset.from_location(folder / "manifest.jsonl"))
    after = epoch(SampleSource(counting, transform, seed=0), 0)
    assert sum(counting.loads.values()) == 3
    assert not np.array_equal(before[0]["arrays"]["target"], after[0]["arrays"]["target"])


def test_corrupt_files_are_quarantined_in_the_first_epoch_of_every_run_and_never_cached(tmp_path):
    folder = tmp_path / "cohort"
    write_synthetic_cohort(folder, 10, shapes=SHAPES, seed=3, corrupt_fraction=0.2)
    dataset = DicomDataset.from_location(folder / "manifest.jsonl")
    for _run in range(2):
        source = SampleSource(dataset, make_transform(tmp_path / "cache"), seed=0)
        items = epoch(source, 0)
        bad = {url for item in items for url, _reason in item["quarantined"]}
        assert len(bad) == 2
        good = {item["provenance"].source for item in items}
        assert len(good) == 8 and not good & bad
    entries = list((tmp_path / "cache" / "prepared").rglob("*.npz"))
    assert len(entries) == 8


def test_a_known_bad_file_is_reported_again_without_being_read_again(tmp_path):
    folder = tmp_path / "cohort"
    write_synthetic_cohort(folder, 4, shapes=SHAPES, seed=3, corrupt_fraction=0.25)
    dataset = CountingDataset(DicomDataset.from_location(folder / "manifest.jsonl"))
    source = SampleSource(dataset, make_transform(tmp_path / "cache"), seed=0)
    first = epoch(source, 0)
    second = epoch(source, 1)
    bad = [url for item in first for url, _ in item["quarantined"]]
    assert bad and bad == [url for item in second for url, _ in item["quarantined"]]
    assert set(dataset.loads.values()) == {1}


def test_cache_false_writes_nothing(cohort, tmp_path):
    transform = make_transform(tmp_path / "cache", cache=False)
    assert transform.cache is None
    epoch(SampleSource(cohort, transform, seed=0), 0)
    assert not (tmp_path / "cache" / "prepared").exists()


def test_loader_workers_fill_the_cache_atomically(cohort, tmp_path):
    transform = make_transform(tmp_path / "cache")
    source = SampleSource(cohort, transform, seed=0)
    # Two workers, two passes over the same samples: entries are written concurrently.
    keys = [(0, i) for i in range(len(cohort))] * 2
    loader = torch.utils.data.DataLoader(source, batch_size=None, sampler=keys, num_workers=2,
                                         collate_fn=lambda item: item)
    assert len(list(loader)) == len(keys)
    folder = transform.cache.folder
    assert not list(folder.rglob(".tmp-*")), "no temporary file is left behind"
    assert all(transform.cache.get(cohort.source(i)) is not None for i in range(len(cohort)))


def test_concurrent_writers_never_expose_a_partial_entry(tmp_path):
    import multiprocessing

    cache = PreparedCache(tmp_path, (8, 64, 64), None)
    source = "file:///volumes/a.dcm"
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_write_many, args=(tmp_path, source, seed)) for seed in (1, 2)]
    for writer in writers:
        writer.start()
    seen = 0
    while any(w.is_alive() for w in writers):
        hit = cache.get(source)
        if hit is not None:
            seen += 1
            assert hit.prepared.shape == (8, 64, 64)
            assert len(np.unique(hit.prepared)) == 1  # one writer's array, whole
    for writer in writers:
        writer.join()
        assert writer.exitcode == 0
    assert cache.get(source) is not None


def _write_many(folder, source, seed):
    from octfw.types import Provenance

    cache = PreparedCache(folder, (8, 64, 64), None)
    provenance = Provenance(source, "d", (1.0, 1.0, 1.0), (8, 64, 64))
    for _ in range(40):
        cache.put(source, np.full((8, 64, 64), float(seed), np.float32), provenance)


def test_an_unwritable_cache_warns_once_and_training_data_still_flows(cohort, tmp_path, caplog):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")
    transform = make_transform(blocker)
    with caplog.at_level(logging.WARNING, logger="octfw"):
        items = epoch(SampleSource(cohort, transform, seed=0), 0)
    assert len(items) == len(cohort)
    assert len([r for r in caplog.records if "cannot write to the cache" in r.getMessage()]) == 1


def entry_sizes(cache_dir: Path) -> list[int]:
    return sorted(p.stat().st_size for p in (cache_dir / "prepared").rglob("*.npz"))


def test_a_cohort_larger_than_the_bound_keeps_the_cache_within_it_and_the_data_flows(cohort, tmp_path):
    reference = epoch(SampleSource(cohort, make_transform(tmp_path / "big"), seed=0), 0)
    bound = sum(entry_sizes(tmp_path / "big")[-3:])  # room for three of the six volumes
    transform = make_transform(tmp_path / "cache", cache_max_bytes=bound)
    dataset = CountingDataset(cohort)
    source = SampleSource(dataset, transform, seed=0)
    for _pass in range(2):
        for item, ref in zip(epoch(source, 0), reference):
            assert item["provenance"] == ref["provenance"]
            for key, value in ref["arrays"].items():
                np.testing.assert_array_equal(item["arrays"][key], value)
            assert transform.cache.files.total_bytes() <= bound
    assert 2 <= len(entry_sizes(tmp_path / "cache")) <= 3
    assert sum(dataset.loads.values()) == 2 * len(cohort)  # in order, LRU keeps none for the next pass


def test_every_option_set_shares_one_bound_and_unused_options_go_first(cohort, tmp_path):
    epoch(SampleSource(cohort, make_transform(tmp_path / "probe"), seed=0), 0)
    bound = sum(entry_sizes(tmp_path / "probe"))  # room for one option set's six volumes
    old = make_transform(tmp_path / "cache", cache_max_bytes=bound)
    new = make_transform(tmp_path / "cache", cache_max_bytes=bound, percentiles=(0.5, 99.5))
    epoch(SampleSource(cohort, old, seed=0), 0)
    epoch(SampleSource(cohort, new, seed=0), 0)
    assert new.cache.files.total_bytes() <= bound
    assert all(old.cache.get(cohort.source(i)) is None for i in range(len(cohort)))
    dataset = CountingDataset(cohort)
    epoch(SampleSource(dataset, new, seed=0), 0)
    assert sum(dataset.loads.values()) == 0, "the newer option set's volumes were kept"


def test_cache_max_bytes_0_writes_nothing(cohort, tmp_path):
    transform = make_transform(tmp_path / "cache", cache_max_bytes=0)
    dataset = CountingDataset(cohort)
    for _pass in range(2):
        epoch(SampleSource(dataset, transform, seed=0), 0)
    assert sum(dataset.loads.values()) == 2 * len(cohort)
    assert not (tmp_path / "cache" / "prepared").exists()


@pytest.mark.parametrize("size", ["500MB", "1.5 GiB", 1024, 0])
def test_cache_max_bytes_takes_bytes_or_a_size(size):
    assert OCTStandardConfig(image_size=IMAGE, cache_max_bytes=size).cache_max_bytes == size


def test_a_bad_cache_max_bytes_is_one_recipe_problem_naming_it(write_recipe, capsys):
    from conftest import TINY_RECIPE

    from octfw.cli.main import main

    recipe = write_recipe(TINY_RECIPE.replace('image_size = [8, 32, 32]',
                                              'image_size = [8, 32, 32]\ncache_max_bytes = "lots"'))
    assert main(["check", str(recipe)]) == 2
    assert ("transform.cache_max_bytes: 'lots' is not a size in bytes; write it like 20GiB, 500MB or 0"
            in capsys.readouterr().err)


# --- balanced domain sampling ---------------------------------------------


DOMAINS = ["a"] * 12 + ["b"] * 3 + ["c"] * 1  # 16 files, very unbalanced


def take(order, n):
    stream = iter(order)
    return [next(stream) for _ in range(n)]


def test_balanced_epochs_draw_every_domain_evenly():
    order = BalancedEpochOrder(DOMAINS, seed=4)
    for number in range(3):
        drawn = take(BalancedEpochOrder(DOMAINS, seed=4, start=16 * number), 16)
        assert {e for e, _ in drawn} == {number}
        counts = collections.Counter(DOMAINS[i] for _, i in drawn)
        assert sorted(counts.values()) == [5, 5, 6], counts
        assert list(order.epoch_order(number)) == [i for _, i in drawn]


def test_balanced_order_spreads_a_large_domain_over_epochs_without_repeats():
    order = BalancedEpochOrder(DOMAINS, seed=0)
    seen = [i for e in range(2) for i in order.epoch_order(e) if DOMAINS[i] == "a"]
    # 12 files of domain a; about 5-6 draws per epoch: two epochs cover 10-12 distinct files.
    assert len(seen) == len(set(seen))


def test_balanced_order_is_a_function_of_seed_and_epoch():
    assert take(BalancedEpochOrder(DOMAINS, seed=1), 40) == take(BalancedEpochOrder(DOMAINS, seed=1), 40)
    assert take(BalancedEpochOrder(DOMAINS, seed=1), 40) != take(BalancedEpochOrder(DOMAINS, seed=2), 40)


def test_balanced_order_resumes_and_shards_like_the_natural_order():
    full = take(BalancedEpochOrder(DOMAINS, seed=3), 40)
    assert take(BalancedEpochOrder(DOMAINS, seed=3, start=13), 27) == full[13:]
    ranks = [take(BalancedEpochOrder(DOMAINS, seed=3, rank=r, world_size=2), 20) for r in (0, 1)]
    assert [x for pair in zip(*ranks) for x in pair] == full
    natural = [take(EpochOrder(16, seed=3, rank=r, world_size=2), 20) for r in (0, 1)]
    assert [x for pair in zip(*natural) for x in pair] == take(EpochOrder(16, seed=3), 40)


def test_make_loader_balances_the_dataset_domains(tmp_path):
    write_synthetic_cohort(tmp_path / "c", 12, ["heidelberg", "topcon"], shapes={
        "heidelberg": (3, 12, 12), "topcon": (3, 12, 12)}, seed=0)
    rows = (tmp_path / "c" / "manifest.jsonl").read_text().splitlines()
    # Keep 6 heidelberg files but only 1 topcon file.
    kept = [r for r in rows if "heidelberg" in r][:6] + [r for r in rows if "topcon" in r][:1]
    (tmp_path / "c" / "small.jsonl").write_text("\n".join(kept) + "\n")
    dataset = DicomDataset.from_location(tmp_path / "c" / "small.jsonl")
    source = SampleSource(dataset, make_transform(tmp_path / "cache"), seed=0)
    natural = make_loader(source, 7, seed=0, start=0, num_workers=0)
    balanced = make_loader(source, 7, seed=0, start=0, num_workers=0, domain_sampling="balanced")
    count = lambda loader: collections.Counter(p.domain for p in next(iter(loader))["provenance"])  # noqa: E731
    assert count(natural) == {"heidelberg": 6, "topcon": 1}
    assert sorted(count(balanced).values()) == [3, 4]


def test_domain_report_lists_counts_per_domain(cohort):
    assert domain_report(cohort) == (
        "dataset: 6 files in 3 domains: heidelberg 2, topcon 2, zeiss 2 (natural sampling)")
    assert domain_report(cohort, "balanced").endswith("(balanced sampling)")
