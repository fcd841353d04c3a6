"""PyTorch integration: a map-style dataset over a FanStore store or mount, and prefetch.

    from torch.utils.data import DataLoader, DistributedSampler
    from fanstore.torch import FanStoreDataset, PrefetchSampler

    ds = FanStoreDataset("/tmp/fs", root="train", transform=decode_sample)
    sampler = PrefetchSampler(DistributedSampler(ds), ds)   # hands each epoch's order over
    loader = DataLoader(ds, batch_size=64, sampler=sampler, num_workers=4)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader: ...

``FanStoreDataset[i]`` is ``transform(bytes)`` (or the bytes) of the i-th file under
``root`` in sorted order, so every process and node agrees on the indices, which is what
``DistributedSampler`` needs. The store is opened once in the parent; DataLoader workers
inherit it after ``fork`` (each gets its own connection to the daemon).

``PrefetchSampler`` wraps any sampler: each time the DataLoader starts an epoch it
materialises the sampler's order (this rank's share) and sends it to a mount in prefetch
mode, so the node's workers fetch and decode ahead of the DataLoader's. The order is sent
from a thread (the first batches are not held up by it) as index entries resolved once per
dataset. With a packed store read in-process there is nothing to hand over and it only
passes through.

torch is an optional dependency: importing this module without it raises ImportError.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

import torch.utils.data as tud

from fanstore.api import open_store

__all__ = ["FanStoreDataset", "PrefetchSampler", "prefetch_epoch"]


class FanStoreDataset(tud.Dataset):
    """Map-style dataset of the files under ``root`` of a store or a live mount."""

    def __init__(self, store, root: str = "", transform: Callable[[bytes], Any] | None = None,
                 files: list[str] | None = None) -> None:
        self.store = open_store(store) if isinstance(store, str) else store
        self.root = root
        self.files = list(files) if files is not None else self.store.files(root)
        self.transform = transform
        self._entries: list[int] | None = None

    def entries(self) -> list[int]:
        """The index entry of every file (resolved once, for prefetch orders)."""
        if self._entries is None:
            found = self.store.ns.file_entries(self.files)
            if min(found, default=0) < 0:  # name the first file that is not there
                self.store.entry_of(self.files[found.index(-1)])
            self._entries = found
        return self._entries

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int):
        data = self.store.read(self.files[index])
        return self.transform(data) if self.transform is not None else data

    def path(self, index: int) -> str:
        return self.files[index]


def prefetch_epoch(dataset: FanStoreDataset, indices) -> dict | None:
    """Send the files of ``indices`` (an epoch's order) to the store's prefetcher."""
    entries = dataset.entries()
    return dataset.store.prefetch_entries([entries[i] for i in indices])


class PrefetchSampler(tud.Sampler):
    """Wraps a sampler; at the start of each epoch hands its order to prefetch mode.

    The order is sent by a thread while the DataLoader starts; an error sending it (the
    mount went away) is raised at the next epoch's start, or by :meth:`wait`.
    """

    def __init__(self, sampler, dataset: FanStoreDataset) -> None:
        self.sampler = sampler
        self.dataset = dataset
        self.last_order: list[int] = []
        self.last_reply: dict | None = None
        self._sender: threading.Thread | None = None
        self._error: BaseException | None = None

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        order = [int(i) for i in self.sampler]
        self.last_order = order
        self.wait()
        self._sender = threading.Thread(target=self._send, args=(order,),
                                        name="fanstore-prefetch-order", daemon=True)
        self._sender.start()
        return iter(order)

    def _send(self, order: list[int]) -> None:
        try:
            self.last_reply = prefetch_epoch(self.dataset, order)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            self._error = exc

    def wait(self) -> dict | None:
        """Wait until the last order was sent; raise what sending it raised."""
        if self._sender is not None:
            self._sender.join()
            self._sender = None
        err, self._error = self._error, None
        if err is not None:
            raise err
        return self.last_reply

    def __len__(self) -> int:
        return len(self.sampler)
