"""``CombinedLoader``: several loaders read as one, in one of Lightning's four modes.

A ``train_dataloader`` that returns a list or dict of loaders is read through one in ``max_size_cycle``
mode (each batch is then a list or dict of the loaders' batches); an evaluation reads a list or dict one
loader after another (``sequential``). Each loader keeps its own sampler: under a data-parallel strategy
each one gets its own distributed sampler (``map_loaders`` rebuilds the combination from the loaders the
strategy processed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from torch.utils._pytree import tree_flatten, tree_unflatten

MODES = ("min_size", "max_size_cycle", "max_size", "sequential")


class CombinedLoader:
    """Lightning's ``CombinedLoader(iterables, mode="min_size")``; ``iterables`` is a list, tuple or dict of
    loaders, nested as deep as you like (``{"a": [loader, loader], "b": loader}``), or one loader.

    - ``min_size``: stops with the shortest loader;
    - ``max_size_cycle``: stops with the longest, the others starting again when they run out;
    - ``max_size``: stops with the longest, the others giving ``None`` once they run out;
    - ``sequential``: each loader whole, one after the other.

    Iterating it yields ``(batch, batch_idx, dataloader_idx)``, as Lightning's does; in the first three
    modes ``batch`` has the structure of ``iterables`` and ``dataloader_idx`` is 0."""

    def __init__(self, iterables: Any, mode: str = "min_size") -> None:
        if mode not in MODES:
            raise ValueError(f"Unsupported mode {mode!r}, please select one of: {list(MODES)}.")
        self._iterables = iterables
        self._mode = mode
        # the loaders are the leaves of the (nested) collection; the spec rebuilds it around their batches
        self._flattened, self._spec = tree_flatten(iterables, is_leaf=_is_plain_sequence)

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def iterables(self) -> Any:
        """The collection of loaders as given (with the processed loaders once ``flattened`` was set)."""
        return self._iterables

    @property
    def flattened(self) -> list[Any]:
        """The loaders, in order (depth first; a dict's in its keys' order)."""
        return list(self._flattened)

    @flattened.setter
    def flattened(self, loaders: list[Any]) -> None:
        if len(loaders) != len(self._flattened):
            raise ValueError(f"CombinedLoader holds {len(self._flattened)} loaders; {len(loaders)} were "
                             f"given")
        self._flattened = list(loaders)
        self._iterables = tree_unflatten(self._flattened, self._spec)

    @property
    def sampler(self) -> Any:
        return self._structured([getattr(loader, "sampler", None) for loader in self._flattened])

    @property
    def batch_sampler(self) -> Any:
        return self._structured([getattr(loader, "batch_sampler", None) for loader in self._flattened])

    def _structured(self, values: list[Any]) -> Any:
        """``values`` (one per loader) in the structure of ``iterables``."""
        return tree_unflatten(values, self._spec)

    def lengths(self) -> list[int | None]:
        return [_length(loader) for loader in self._flattened]

    def __len__(self) -> int:
        lengths = self.lengths()
        if None in lengths:
            raise TypeError("a CombinedLoader over a loader without a length has no length")
        if not lengths:
            return 0
        if self._mode == "sequential":
            return sum(lengths)
        return min(lengths) if self._mode == "min_size" else max(lengths)

    def __iter__(self) -> CombinedIterator:
        return CombinedIterator(self, with_indices=True)

    def batches(self) -> CombinedBatches:
        """The combination as a training loop reads it: the batches alone."""
        return CombinedBatches(self)


class CombinedBatches:
    """A ``CombinedLoader`` read for its batches only (what the loops iterate); ``combined`` is the loader."""

    def __init__(self, combined: CombinedLoader) -> None:
        self.combined = combined

    @property
    def flattened(self) -> list[Any]:
        return self.combined.flattened

    def __len__(self) -> int:
        return len(self.combined)

    def __iter__(self) -> CombinedIterator:
        return CombinedIterator(self.combined, with_indices=False)


class CombinedIterator(Iterator[Any]):
    """One pass over a ``CombinedLoader``. Every loader's iterator is made when the pass begins (in
    ``sequential`` mode each when its turn comes), as Lightning's are, so each draws from the random state
    at the same point."""

    def __init__(self, combined: CombinedLoader, with_indices: bool) -> None:
        self.combined = combined
        self.with_indices = with_indices
        self.loaders = combined.flattened
        self.consumed = [False] * len(self.loaders)
        self.batch_idx = 0
        self.current = 0  # sequential mode: the loader being read
        if combined.mode == "sequential":
            self.iterators: list[Iterator[Any] | None] = [None] * len(self.loaders)
            if self.loaders:
                self.iterators[0] = iter(self.loaders[0])
        else:
            self.iterators = [iter(loader) for loader in self.loaders]

    def __iter__(self) -> CombinedIterator:
        return self

    def __next__(self) -> Any:
        mode = self.combined.mode
        if mode == "sequential":
            return self._next_in_sequence()
        if not self.loaders:
            raise StopIteration
        out: list[Any] = [None] * len(self.loaders)
        for i, iterator in enumerate(self.iterators):
            try:
                out[i] = next(iterator)
            except StopIteration:
                self.consumed[i] = True
                if mode == "min_size" or all(self.consumed):
                    self._shutdown_workers()
                    raise
                if mode == "max_size_cycle":  # from its start again (a new epoch of that loader)
                    self.iterators[i] = iter(self.loaders[i])
                    out[i] = next(self.iterators[i])
        batch = self.combined._structured(out)
        result = (batch, self.batch_idx, 0) if self.with_indices else batch
        self.batch_idx += 1
        return result

    def _next_in_sequence(self) -> Any:
        while self.current < len(self.loaders):
            iterator = self.iterators[self.current]
            if iterator is None:
                iterator = self.iterators[self.current] = iter(self.loaders[self.current])
            try:
                batch = next(iterator)
            except StopIteration:
                self.current += 1
                self.batch_idx = 0
                continue
            result = (batch, self.batch_idx, self.current) if self.with_indices else batch
            self.batch_idx += 1
            return result
        raise StopIteration

    def _shutdown_workers(self) -> None:
        """Stop the worker processes of every loader's iterator (``data.loaders.stop_workers``)."""
        for iterator in self.iterators:
            stop = getattr(iterator, "_shutdown_workers", None)
            if callable(stop):
                stop()


def map_loaders(loader: Any, fn: Callable[[Any], Any]) -> Any:
    """``loader`` with ``fn`` applied to each loader it combines (a ``CombinedLoader``'s, kept in its mode),
    or to itself."""
    combined = loader.combined if isinstance(loader, CombinedBatches) else loader
    if isinstance(combined, CombinedLoader):
        out = CombinedLoader(combined.iterables, combined.mode)
        out.flattened = [fn(one) for one in combined.flattened]
        return out.batches() if isinstance(loader, CombinedBatches) else out
    return fn(loader)


def component_loaders(loader: Any) -> list[Any]:
    """The loaders ``loader`` reads: a combination's, or itself."""
    flattened = getattr(loader, "flattened", None)
    return list(flattened) if isinstance(flattened, list) else [loader]


def _is_plain_sequence(node: Any) -> bool:
    """A list, tuple or dict of plain values (``[0, 1, 2]``) is one iterable to read, not a collection of
    loaders to take apart."""
    if isinstance(node, Mapping):
        children: Iterable[Any] = node.values()
    elif isinstance(node, (list, tuple)):
        children = node
    else:
        return False
    return all(isinstance(child, (int, float, str)) for child in children)


def _length(loader: Iterable[Any]) -> int | None:
    try:
        return len(loader)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        return None
