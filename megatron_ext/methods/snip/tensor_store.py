"""Where a SNIP refresh keeps tensors between their uses (``--snip-offload``).

A refresh keeps three kinds of tensors from one use to a later one: the weight snapshot
(:class:`~megatron_ext.methods.snip.refresh.WeightSnapshot`), AdamW's ``A²`` of every site
(:mod:`.adam`) and each site's base-pass gradient (:class:`~.stats.SiteObserver`). A
:class:`TensorStore` takes each (:meth:`TensorStore.put`) and gives back a :class:`Stored`
handle whose :meth:`Stored.get` brings the tensor back where it is used:

* in memory (``none``: where the tensor already is; ``host``: CPU memory): the handle holds
  the tensor itself, for ``host`` a copy; from a GPU that copy goes to pinned memory queued
  on the stream (``non_blocking``, a CUDA event after it) and comes back the same way, so
  neither direction waits for the GPU; only the host reading the copy waits, on the event
  (a blocking copy each way per tensor was a synchronisation each: 125 reads and 139
  uploads per refresh of the tiny model, benchmarks/results/2026-11-27-host-syncs.md).
  Pinned memory stays with torch's caching host allocator after the refresh;
* ``disk``: the tensor is written to a file (``torch.save``) in a folder of its own under the
  run directory and read back (``torch.load``) at each use, so memory holds one site's
  tensor at a time. Page cache is not resident memory of the process; memory-mapped files
  would be, so files are read, not mapped. :meth:`TensorStore.close` removes the folder (the
  refresh uses the store as a ``with`` block; a store never closed is removed when collected
  or at exit).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass

import torch

OFFLOADS = ("auto", "host", "disk", "none")
"""``--snip-offload`` choices."""


def on_device(total: torch.Tensor) -> torch.Tensor:
    """``float(total)``'s value without reading it: a float64 0-dim tensor on ``total``'s
    device. A refresh adds its statistics as these and reads them to the host once, all
    sites together (``refresh.reduce_statistics``); a ``float()`` per term was a host
    synchronisation per site, statistic and micro-batch on a GPU (~700 for the tiny model)."""
    return total.double()


def resolve(offload: str, device_type: str) -> str:
    """``--snip-offload`` on a model on ``device_type``: ``auto`` keeps the refresh's
    tensors out of the memory training uses, ``host`` on a GPU and ``disk`` elsewhere (on
    CPU the host is that memory); the others are themselves."""
    if offload == "auto":
        return "host" if device_type == "cuda" else "disk"
    return offload


@dataclass
class Stored:
    """One tensor put in a :class:`TensorStore`."""

    tensor: torch.Tensor | None = None
    """The tensor itself (a store in memory); None on disk or once freed."""
    path: str | None = None
    """Its file (a store on disk); None in memory or once freed."""
    total: torch.Tensor | None = None
    """The float64 sum of its elements, made where it was put (``put(total=True)``)."""
    host_copy: bool = False
    """Whether :attr:`tensor` is a host copy made by :meth:`TensorStore.put` (``host``)."""
    ready: object = None
    """A host copy of a CUDA tensor: the CUDA event recorded after its copy was queued
    (:meth:`TensorStore.put` does not wait for it); None otherwise."""

    def get(self, device: torch.device | None = None) -> torch.Tensor:
        """The tensor on ``device`` (None: where it is kept; from disk: where it was put).
        A host copy goes back to a device without a wait (queued after the copy out, on the
        same stream); the host itself waits for the copy out before it reads."""
        if self.path is not None:
            return torch.load(self.path, map_location=device, weights_only=True)
        if device is not None and (self.host_copy or torch.device(device) != self.tensor.device):
            moved = self.tensor.to(device, non_blocking=self.host_copy)
            if moved is not self.tensor:
                return moved
        if self.ready is not None:  # the host copy itself (also asked for on the host)
            self.ready.synchronize()
        return self.tensor

    def free(self) -> None:
        """Drop the tensor (its file too); :meth:`get` then fails."""
        if self.path is not None:
            os.remove(self.path)
        self.tensor = self.path = self.total = self.ready = None
        self.host_copy = False


class TensorStore:
    """Keeps tensors in memory on one device, or in files of one folder (module docstring)."""

    def __init__(self, device: torch.device | None = None, folder: str | None = None):
        self.device = device
        """In memory: where tensors are kept (None: where each already is)."""
        self.folder = folder
        """On disk: the folder of the files (None: in memory)."""
        self._files = 0
        """Files written so far (each gets the next number as its name)."""
        self._remove = weakref.finalize(self, shutil.rmtree, folder, True) if folder else None
        """Removes the folder once: at :meth:`close`, when collected, or at exit."""

    @classmethod
    def for_offload(cls, offload: str, parent: str) -> TensorStore:
        """The store of a resolved ``--snip-offload`` (:func:`resolve`): ``disk`` makes a new
        folder ``snip_offload_*`` under ``parent`` (the run directory)."""
        if offload == "disk":
            os.makedirs(parent, exist_ok=True)
            return cls(folder=tempfile.mkdtemp(prefix="snip_offload_", dir=parent))
        return cls(torch.device("cpu") if offload == "host" else None)

    def put(self, tensor: torch.Tensor, copy: bool = False, total: bool = False) -> Stored:
        """Keep ``tensor`` (``none``: itself, a new copy with ``copy``; ``host`` and
        ``disk``: always a copy, of its elements only); with ``total``, its float64 sum is
        made first, where it is (:attr:`Stored.total`)."""
        summed = on_device(tensor.double().sum()) if total else None
        if self.folder is None:
            if self.device is None:
                return Stored(tensor.clone() if copy else tensor, total=summed)
            return _host_copy(tensor, summed)
        path = os.path.join(self.folder, f"{self._files}.pt")
        self._files += 1
        tensor = tensor.detach()
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()  # a view: torch.save would write its whole storage
        torch.save(tensor, path)
        return Stored(path=path, total=summed)

    def close(self) -> None:
        """Remove the folder and every file in it (in memory: nothing to do)."""
        if self._remove is not None:
            self._remove()

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc) -> None:
        """Leaving a ``with`` block, normally or by an exception: :meth:`close`."""
        self.close()


def _host_copy(tensor: torch.Tensor, total: torch.Tensor | None) -> Stored:
    """A host copy of ``tensor`` that the host does not wait for: from a CUDA tensor into
    pinned memory, queued on the current stream (:attr:`Stored.ready` marks its end)."""
    cuda = tensor.is_cuda
    host = torch.empty_like(tensor, device="cpu", pin_memory=cuda)
    host.copy_(tensor.detach(), non_blocking=True)
    ready = None
    if cuda:
        ready = torch.cuda.Event()
        ready.record()
    return Stored(host, total=total, host_copy=True, ready=ready)

