"""The saved-tensor hooks count a saved storage by the storage, not by the address it had when saved."""

import torch

from snn_explorer.estimator.instruments.storage import LiveSaved, SavedAlive


def _two_storages_at_one_address():
    """Two distinct storages over the same memory: what the hooks meet when a storage saved earlier outlives,
    as a Python object, the place a later saved storage now holds."""
    memory = bytearray(64)
    first, second = torch.frombuffer(memory, dtype=torch.float32), torch.frombuffer(memory, dtype=torch.float32)
    assert first.untyped_storage() is not second.untyped_storage()
    assert first.data_ptr() == second.data_ptr()
    return memory, first, second


def test_a_storage_saved_where_another_was_is_counted_once_the_other_goes():
    _memory, first, second = _two_storages_at_one_address()
    saved = SavedAlive()
    for t in (first, second, second):  # the same storage saved twice is one storage
        saved.pack(t)
    assert saved.alive() == {second.data_ptr(): 64}
    del first
    assert saved.alive() == {second.data_ptr(): 64}


def test_a_resized_storage_is_counted_where_it_is_now():
    t = torch.zeros(16)
    saved = SavedAlive()
    saved.pack(t)
    t.untyped_storage().resize_(128)  # FSDP2 frees and refills its unsharded parameters this way
    assert saved.alive() == {t.untyped_storage().data_ptr(): 128}


def test_live_bytes_count_each_storage_saved_at_one_address():
    _memory, first, second = _two_storages_at_one_address()
    saved = LiveSaved(skip=set())
    for t in (first, second, first):
        saved.pack(t)
    del t
    assert (saved.current, saved.peak) == (128, 128)
    del first
    assert (saved.current, saved.peak) == (64, 128)
    del second
    assert saved.current == 0
