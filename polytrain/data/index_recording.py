"""Which dataset indices each batch of a loader held: what a prediction writer saves beside the
predictions, so that every rank's share can be put back in dataset order afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset


class IndexRecordingBatchSampler:
    """Yields the wrapped batch sampler's batches and keeps them: ``seen_batch_indices[i]`` is batch i's
    indices. With DataLoader workers the loader draws batches ahead of the loop, so index by batch number."""

    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler = batch_sampler
        self.seen_batch_indices: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        self.seen_batch_indices = []
        for batch in self.batch_sampler:
            self.seen_batch_indices.append(list(batch))
            yield batch

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __getattr__(self, name: str) -> Any:  # sampler, batch_size, drop_last, set_epoch: the wrapped one's
        if name == "batch_sampler":
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)


def with_index_recording(loader: Any) -> Any:
    """``loader`` rebuilt around an ``IndexRecordingBatchSampler`` (same dataset, sampler order, workers,
    collate), or ``loader`` itself when it has no batch sampler to record (an iterable dataset, not a
    ``DataLoader``): then there are no indices to report."""
    if (not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset)
            or loader.batch_sampler is None or isinstance(loader.batch_sampler, IndexRecordingBatchSampler)):
        return loader
    kwargs: dict[str, Any] = dict(
        batch_sampler=IndexRecordingBatchSampler(loader.batch_sampler), num_workers=loader.num_workers,
        collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator, persistent_workers=loader.persistent_workers,
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, **kwargs)


def recorded_indices(loader: Any) -> list[list[int]] | None:
    sampler = getattr(loader, "batch_sampler", None)
    return sampler.seen_batch_indices if isinstance(sampler, IndexRecordingBatchSampler) else None
