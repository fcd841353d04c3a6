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
materialises the sampler's order (this rank's share) and sends the corresponding paths to a
mount in prefetch mode, so the daemon fetches and decodes ahead of the workers. With a
packed store read in-process there is nothing to hand over and it only passes through.

torch is an optional dependency: importing this module without it raises ImportError.
"""

from __future__ import annotations

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

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int):
        data = self.store.read(self.files[index])
        return self.transform(data) if self.transform is not None else data

    def path(self, index: int) -> str:
        return self.files[index]


def prefetch_epoch(dataset: FanStoreDataset, indices) -> dict | None:
    """Send the paths of ``indices`` (an epoch's order) to the store's prefetcher."""
    paths = [dataset.files[i] for i in indices]
    return dataset.store.prefetch(paths)


class PrefetchSampler(tud.Sampler):
    """Wraps a sampler; at the start of each epoch hands its order to prefetch mode."""

    def __init__(self, sampler, dataset: FanStoreDataset) -> None:
        self.sampler = sampler
        self.dataset = dataset
        self.last_order: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        order = [int(i) for i in self.sampler]
        self.last_order = order
        prefetch_epoch(self.dataset, order)
        return iter(order)

    def __len__(self) -> int:
        return len(self.sampler)
