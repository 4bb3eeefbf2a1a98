"""The step-indexed order: a bijection per epoch, exactly-once over 1-4 processes, resume anywhere."""

import tracemalloc

import numpy as np
import pytest

from olmo_eqx.data.instances import InstanceDataset
from olmo_eqx.data.loader import DataLoader, Prefetcher
from olmo_eqx.data.mixes import source_from_paths
from olmo_eqx.data.permutation import FeistelPermutation
from olmo_eqx.data.sampler import LoaderState, StepSampler
from olmo_eqx.data.token_files import DataFileError
from test_data_support import VOCAB, make_token_files

SEQ = 8
BATCH = 12  # divisible by 1, 2, 3 and 4 processes


@pytest.fixture
def dataset(tmp_path):
    # 3 files, 101 instances in all: an epoch of 8 steps drops 5 instances.
    make_token_files(tmp_path, [40 * SEQ + 3, 37 * SEQ, 24 * SEQ + 7])
    return InstanceDataset([source_from_paths("synthetic", tmp_path / "*.npy")], SEQ, VOCAB)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 16, 17, 100, 257, 1000, 4096, 5000])
def test_feistel_is_a_bijection(n):
    for seed in (0, 1, 12345):
        values = FeistelPermutation(n, seed)(np.arange(n))
        np.testing.assert_array_equal(np.sort(values), np.arange(n))


def test_feistel_depends_on_seed_and_shuffles():
    a = FeistelPermutation(1000, 1)(np.arange(1000))
    b = FeistelPermutation(1000, 2)(np.arange(1000))
    assert not np.array_equal(a, b)
    assert (a == np.arange(1000)).sum() < 20  # not close to the identity


def test_order_for_a_billion_instances_needs_no_memory():
    n = 10**9
    tracemalloc.start()
    permutation = FeistelPermutation(n, seed=34521)
    sampler = StepSampler(n, global_batch_size=512, seed=34521)
    last = sampler.global_batch(sampler.steps_per_epoch - 1)  # the last step of epoch 0, directly
    values = permutation(np.arange(n - 4096, n))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1_000_000  # bytes, and most of it is the 4096 positions being mapped
    assert len(np.unique(values)) == 4096 and values.min() >= 0 and values.max() < n
    assert len(np.unique(last)) == 512


def simulate(dataset, steps, process_count, seed=7, start_state=None):
    """Every process's batches for `steps` steps, joined per step in process order."""
    loaders = [DataLoader(dataset, BATCH, seed, p, process_count, state=start_state) for p in range(process_count)]
    steps_out = []
    for _ in range(steps):
        parts = [loader.next_batch() for loader in loaders]
        assert len({b.step for b in parts}) == 1
        steps_out.append(
            (
                np.concatenate([b.instance_ids for b in parts]),
                np.concatenate([b.input_ids for b in parts]),
            )
        )
    return steps_out, loaders


@pytest.mark.parametrize("process_count", [1, 2, 3, 4])
def test_exactly_once_per_epoch_for_any_process_count(dataset, process_count):
    spe = len(dataset) // BATCH
    assert spe == 8
    one, _ = simulate(dataset, 2 * spe, 1)
    many, loaders = simulate(dataset, 2 * spe, process_count)
    for (ids_1, tokens_1), (ids_p, tokens_p) in zip(one, many):
        np.testing.assert_array_equal(ids_p, ids_1)  # the union is the one-process order
        np.testing.assert_array_equal(tokens_p, tokens_1)
    for epoch in range(2):
        served = np.concatenate([ids for ids, _ in many[epoch * spe : (epoch + 1) * spe]])
        assert len(np.unique(served)) == len(served) == spe * BATCH  # no repeats
        assert set(served.tolist()) <= set(range(len(dataset)))
    # epochs use different orders, and process slices are disjoint
    assert not np.array_equal(many[0][0], many[spe][0])
    # content matches the instance: token t of instance i is its first token + t
    ids, tokens = many[3]
    np.testing.assert_array_equal(tokens - tokens[:, :1], np.broadcast_to(np.arange(SEQ), tokens.shape))
    assert loaders[0].state.epoch == 2 and loaders[0].state.instances_consumed == 2 * spe * BATCH


@pytest.mark.parametrize("before, after", [(1, 1), (2, 4), (4, 3), (3, 1)])
def test_resume_on_any_process_count_gives_the_same_batches(dataset, before, after):
    total, cut = 20, 11  # crosses an epoch boundary after the resume
    uninterrupted, _ = simulate(dataset, total, 1)
    _, loaders = simulate(dataset, cut, before)
    states = {loader.state for loader in loaders}
    assert len(states) == 1  # every process holds the same data position
    state = LoaderState.from_dict(dict(states.pop().to_dict()))  # as a checkpoint would store it
    assert state.step == cut
    resumed, _ = simulate(dataset, total - cut, after, start_state=state)
    for (ids_a, tok_a), (ids_b, tok_b) in zip(uninterrupted[cut:], resumed):
        np.testing.assert_array_equal(ids_a, ids_b)
        np.testing.assert_array_equal(tok_a, tok_b)


def test_batches_are_deterministic_for_seed_and_step(dataset):
    a = DataLoader(dataset, BATCH, seed=3).batch_at(5)
    b = DataLoader(dataset, BATCH, seed=3).batch_at(5)
    c = DataLoader(dataset, BATCH, seed=4).batch_at(5)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    assert not np.array_equal(a.instance_ids, c.instance_ids)
    assert a.input_ids.dtype == np.int32 and a.loss_mask.dtype == np.float32 and (a.loss_mask == 1).all()
    assert a.step == 5 and a.epoch == 0 and (a.source_ids == 0).all()


def test_resume_on_another_dataset_is_refused(dataset, tmp_path_factory):
    state = DataLoader(dataset, BATCH, seed=7).state
    other_dir = tmp_path_factory.mktemp("other")
    make_token_files(other_dir, [50 * SEQ])
    other = InstanceDataset([source_from_paths("synthetic", other_dir / "*.npy")], SEQ, VOCAB)
    with pytest.raises(DataFileError, match="data fingerprint .* differs"):
        DataLoader(other, BATCH, seed=7, state=state)
    with pytest.raises(DataFileError, match="data seed is 7"):
        DataLoader(dataset, BATCH, seed=8, state=state)
    moved = LoaderState(seed=7, epoch=0, step=3, instances_consumed=3 * 6, fingerprint=state.fingerprint)
    with pytest.raises(DataFileError, match="keep the global batch size"):
        DataLoader(dataset, BATCH, seed=7, state=moved)
    # the same data under another sequence length is another dataset
    reshaped = InstanceDataset(list(dataset.sources), 2 * SEQ, VOCAB)
    with pytest.raises(DataFileError, match="fingerprint"):
        DataLoader(reshaped, 6, seed=7, state=state)


def test_batch_size_must_split_over_processes(dataset):
    with pytest.raises(DataFileError, match="divisible by the process count"):
        DataLoader(dataset, 10, seed=0, process_index=0, process_count=4)


def test_prefetcher_hands_out_the_same_batches_and_tracks_position(dataset):
    expected = [DataLoader(dataset, BATCH, seed=1).batch_at(s) for s in range(12)]
    loader = DataLoader(dataset, BATCH, seed=1)
    with Prefetcher(loader, depth=3) as prefetcher:
        for step, want in enumerate(expected):
            got = next(prefetcher)
            np.testing.assert_array_equal(got.input_ids, want.input_ids)
            # read-ahead must not leak into the checkpointed position
            assert prefetcher.state.step == step + 1


def test_prefetcher_reraises_a_read_error_in_the_trainer_thread(tmp_path):
    make_token_files(tmp_path, [40 * SEQ])
    dataset = InstanceDataset([source_from_paths("gone", tmp_path / "*.npy")], SEQ, VOCAB)
    for path in tmp_path.glob("*.npy"):
        path.unlink()  # vanishes after the dataset was opened (files are mapped lazily)
    with Prefetcher(DataLoader(dataset, BATCH, seed=0)) as prefetcher:
        with pytest.raises(FileNotFoundError):
            next(prefetcher)
        assert prefetcher.state.step == 0
