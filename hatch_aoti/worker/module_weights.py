"""The compiled model run on the eager module's own weights while it is verified.

Verification loads the mapped weights file the wheel ships; left as it is, it would be a second
copy of the model's weights in the coordinator's memory, beside the module's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def use_module_weights(module: Any, compiled: Any, directory: Path, weights: dict[str, Any]) -> None:
    """Let the compiled model run on the eager module's own weights while it is verified.

    The mapped weights file would otherwise be a second copy of them in memory (the
    module's cannot be freed: Inductor keeps references to them). Each weight the module
    has too is first compared, byte for byte, with its place in the file, read in chunks
    without mapping it, so the file that ships is checked all the same. Freezing renames
    the weights it keeps as they are (a linear layer's, transposed: a view of the same
    storage), so a constant is also matched to a module tensor holding its storage's bytes.
    """
    fqns = compiled.runner.get_constant_names_to_original_fqns()
    owners = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    constants = dict(compiled.weights)
    with (directory / weights["file"]).open("rb") as blob:
        storages = _StorageOwners(module.parameters(), blob)  # not buffers: the model may write them
        for constant, mapped in compiled.weights.items():
            if mapped.is_mkldnn:
                continue  # packed at load from a constant Inductor made: no module tensor holds it
            fqn = fqns.get(constant, "")
            own = owners.get(fqn)
            if own is None or (own.shape, own.stride(), own.dtype) != (mapped.shape, mapped.stride(), mapped.dtype):
                own = storages.view(mapped, weights["tensors"][fqn])  # one Inductor made or laid out anew
            elif not own.is_contiguous():
                own = None  # a view with gaps (a transposed slice, say): verified from the file
            elif not _same_bytes(own, blob, weights["tensors"][fqn]):
                raise RuntimeError(f"the shipped weights file holds other values for {fqn} than the model")
            if own is not None:
                constants[constant] = own.detach()
    compiled.runner.update_constant_buffer(constants, False, True, True)


class _StorageOwners:
    """The module's parameters that each hold a whole storage, found by a constant's storage in the file
    (indexed on first need)."""

    PREFIX = 64

    def __init__(self, tensors: Any, blob: Any) -> None:
        self.tensors, self.blob = list(tensors), blob
        self.found: dict[tuple[Any, int, bytes], list[Any]] | None = None

    def view(self, mapped: Any, place: dict[str, Any]) -> Any:
        """A parameter's storage viewed as ``mapped`` is, if its bytes are the file's; else None."""
        if self.found is None:
            self.found = {}
            for tensor in filter(_whole_storage, self.tensors):
                key = (tensor.dtype, tensor.nbytes, _head(tensor, self.PREFIX))
                self.found.setdefault(key, []).append(tensor)
        self.blob.seek(place["offset"])
        head = self.blob.read(min(self.PREFIX, place["nbytes"]))
        whole = {**place, "storage_offset": 0}
        for own in self.found.get((mapped.dtype, place["nbytes"], head), []):
            if _same_bytes(own, self.blob, whole):
                return own.as_strided(mapped.shape, mapped.stride(), place["storage_offset"])
        return None


def _whole_storage(tensor: Any) -> bool:
    """A dense CPU tensor, laid out from the start of its storage to its end."""
    import torch

    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided:
        return False  # sparse, mkldnn or a tensor subclass: no plain storage to compare
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.storage_offset() or not tensor.data_ptr():
        return False
    return bool(tensor.nbytes) and tensor.nbytes == tensor.untyped_storage().nbytes()


def _same_bytes(tensor: Any, blob: Any, place: dict[str, Any]) -> bool:
    import ctypes

    view = memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")
    blob.seek(place["offset"] + place["storage_offset"] * tensor.element_size())
    chunk = 1 << 24
    for start in range(0, len(view), chunk):
        if blob.read(min(chunk, len(view) - start)) != view[start : start + chunk]:
            return False
    return True


def _head(tensor: Any, size: int) -> bytes:
    import ctypes

    return ctypes.string_at(tensor.data_ptr(), min(size, tensor.nbytes))
