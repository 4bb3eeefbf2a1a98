"""The memorisation bug, planted: a loader that re-strides its already-sharded stream by process.

Spec section 6: single-process tests cannot see it (the re-stride is the identity), so the
audit and the run-time guard must catch it with several processes.
"""

import itertools

import numpy as np
import pytest

from olmo_eqx.data.audit import audit_loader, loader_streams, main as audit_main
from olmo_eqx.data.guard import RepeatError, RepeatGuard, audit_stream
from olmo_eqx.data.heldout import document_bounds, heldout_overlap, heldout_sets, split_train_heldout
from olmo_eqx.data.instances import InstanceDataset
from olmo_eqx.data.loader import DataLoader
from olmo_eqx.data.mixes import source_from_paths
from olmo_eqx.data.token_files import TokenFile, write_token_file
from test_data_support import VOCAB, make_token_files

SEQ = 8
BATCH = 8


@pytest.fixture
def dataset(tmp_path):
    make_token_files(tmp_path, [200 * SEQ])
    return InstanceDataset([source_from_paths("synthetic", tmp_path / "*.npy")], SEQ, VOCAB)


def double_sharded(loader: DataLoader):
    """The bug: takes every P-th id of this process's (already sliced) stream, from offset p."""
    flat = itertools.chain.from_iterable(loader.local_instance_ids(s).tolist() for s in itertools.count())
    restrided = itertools.islice(flat, loader.process_index, None, loader.process_count)
    while True:
        yield np.array(list(itertools.islice(restrided, loader.local_batch_size)), dtype=np.int64)


def double_sharded_streams(dataset):
    def streams(process_index, process_count):
        return double_sharded(DataLoader(dataset, BATCH, 0, process_index, process_count, guard=False))

    return streams


def test_audit_passes_the_real_loader(dataset):
    reports = audit_loader(dataset, BATCH, seed=0, process_counts=[1, 2, 4])
    assert all(r.ok for r in reports), [r.summary() for r in reports]
    assert reports[0].steps == len(dataset) // BATCH + 1


def test_audit_catches_double_sharding(dataset):
    reference = DataLoader(dataset, BATCH, 0).sampler
    steps = reference.steps_per_epoch
    # one process: the re-stride is the identity, which is why unit tests missed the bug
    assert audit_stream(double_sharded_streams(dataset), reference, 1, steps).ok
    report = audit_stream(double_sharded_streams(dataset), reference, 2, steps)
    assert not report.ok
    assert report.wrong_batches and report.duplicates
    assert "duplicate" in report.summary() and report.summary().startswith("PROBLEM")


def test_guard_stops_double_sharding_naming_instance_and_steps(dataset):
    loader = DataLoader(dataset, BATCH, 0, process_index=0, process_count=2)
    guard = RepeatGuard(len(dataset), loader.steps_per_epoch)
    with pytest.raises(RepeatError, match=r"instance \d+ served at step \d+ was already served at step \d+ of epoch 0"):
        for step, ids in zip(range(loader.steps_per_epoch), double_sharded(loader)):
            guard.check(step, ids)


def test_guard_accepts_the_real_loader_over_several_epochs(dataset):
    for p in range(2):
        loader = DataLoader(dataset, BATCH, 0, process_index=p, process_count=2)  # guard on by default
        for _ in range(int(2.5 * loader.steps_per_epoch)):
            loader.next_batch()


def test_guard_catches_a_repeat_inside_one_batch():
    guard = RepeatGuard(100, steps_per_epoch=10)
    with pytest.raises(RepeatError, match="instance 4 was served twice within step 0"):
        guard.check(0, np.array([1, 4, 4]))


def test_guard_resets_each_epoch():
    guard = RepeatGuard(10, steps_per_epoch=2)
    guard.check(0, np.array([0, 1]))
    guard.check(1, np.array([2, 3]))
    guard.check(2, np.array([0, 1]))  # epoch 1 may serve them again
    with pytest.raises(RepeatError, match="instance 1 served at step 3 was already served at step 2 of epoch 1"):
        guard.check(3, np.array([1, 9]))


def _docs(*docs, eos):
    return np.concatenate([np.append(np.asarray(d), eos) for d in docs])


def test_split_by_document_has_no_overlap_and_keeps_every_document(tmp_path):
    eos = 0
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 500, size=rng.integers(3, 40)) for _ in range(300)]
    docs += [docs[5], docs[7]]  # exact duplicates must land on the same side
    source = write_token_file(tmp_path / "corpus.npy", _docs(*docs, eos=eos), 500)
    train, heldout = split_train_heldout([TokenFile(source, 500)], eos, 0.2, tmp_path / "split")
    train_f, heldout_f = TokenFile(train, 500), TokenFile(heldout, 500)
    assert heldout_overlap([train_f], [heldout_f], eos) == 0
    n_train = len(document_bounds(np.asarray(train_f.tokens), eos))
    n_heldout = len(document_bounds(np.asarray(heldout_f.tokens), eos))
    assert n_train + n_heldout == len(docs)
    assert 30 < n_heldout < 100
    # and the check does see an overlap when there is one
    leaked = write_token_file(tmp_path / "leaked.npy", _docs(docs[0], docs[1], eos=eos), 500)
    assert heldout_overlap([train_f, TokenFile(leaked, 500)], [heldout_f, TokenFile(leaked, 500)], eos) == 2


def test_heldout_sets_read_in_fixed_order_with_padding(tmp_path):
    make_token_files(tmp_path, [10 * SEQ + 2], prefix="c4")
    (heldout,) = heldout_sets([source_from_paths("c4-validation", tmp_path / "c4-*.npy")], SEQ, VOCAB)
    assert heldout.name == "c4-validation" and heldout.num_batches(4) == 3
    for process_count in (1, 2):
        seen = []
        for p in range(process_count):
            batches = list(heldout.batches(4, p, process_count))
            assert [b.step for b in batches] == [0, 1, 2]
            seen.append(batches)
        rows = [np.concatenate([seen[p][j].instance_ids for p in range(process_count)]) for j in range(3)]
        np.testing.assert_array_equal(np.concatenate(rows), list(range(10)) + [-1, -1])
    last = list(heldout.batches(4))[-1]
    np.testing.assert_array_equal(last.loss_mask[:, 0], [1, 1, 0, 0])
    assert last.loss_mask.dtype == np.float32
    np.testing.assert_array_equal(last.input_ids[:, 0], [8 * SEQ, 9 * SEQ, 0, 0])


def test_audit_cli_exit_codes(tmp_path, capsys):
    eos = 0
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, 900, size=30) for _ in range(120)]
    write_token_file(tmp_path / "train.npy", _docs(*docs[:100], eos=eos), 1000)
    write_token_file(tmp_path / "clean.npy", _docs(*docs[100:], eos=eos), 1000)
    write_token_file(tmp_path / "leaky.npy", _docs(*docs[95:], eos=eos), 1000)
    common = ["--files", str(tmp_path / "train.npy"), "--vocab-size", "1000", "--sequence-length", "16", "--batch-size", "12"]
    assert audit_main(common + ["--heldout", str(tmp_path / "clean.npy"), "--eos-id", "0"]) == 0
    assert "OK: 4 process(es)" in capsys.readouterr().out
    assert audit_main(common + ["--heldout", str(tmp_path / "leaky.npy"), "--eos-id", "0"]) == 1
    assert "PROBLEM: 5 held-out document(s)" in capsys.readouterr().out
    assert audit_main(["--files", str(tmp_path / "missing.npy"), "--vocab-size", "1000"]) == 1
    assert "missing.npy does not exist" in capsys.readouterr().err


def test_loader_streams_are_the_loader_rows(dataset):
    streams = loader_streams(dataset, BATCH, seed=0)
    first = next(streams(1, 2))
    np.testing.assert_array_equal(first, DataLoader(dataset, BATCH, 0, 1, 2).next_batch().instance_ids)
