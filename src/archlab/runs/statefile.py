"""Nested training state (optimizer, RNG states, counters) as one safetensors file: data only, no pickle.

A trainer state is a tree of dicts, lists, tuples, numbers, strings, tensors and NumPy arrays (NumPy's
RNG state). `save_state` stores every tensor and array in a safetensors file and the tree around them
as JSON in that file's metadata; `load_state` rebuilds the tree. Loading reads bytes and JSON only, so
a run folder someone else wrote cannot run code on the machine that resumes it (a pickle can: its
`__reduce__` may call anything). Anything else in the tree is a bug and raises TypeError at save time.

>>> import torch, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "trainer.safetensors")
>>> save_state({"step": 3, "rng": (1, torch.zeros(2)), "state": {0: {"lr": 0.1}}}, path)
>>> load_state(path)
{'step': 3, 'rng': (1, tensor([0., 0.])), 'state': {0: {'lr': 0.1}}}
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

from archlab.errors import os_errors_of

__all__ = ["save_state", "load_state", "load_legacy_pickle"]

_TENSOR, _ARRAY, _TUPLE, _ITEMS = "__tensor__", "__ndarray__", "__tuple__", "__items__"
_MARKERS = {_TENSOR, _ARRAY, _TUPLE, _ITEMS}


def _flatten(obj: Any, tensors: dict[str, torch.Tensor], seen: set[int]) -> Any:
    """`obj` as JSON, with tensors and arrays moved into `tensors` under generated keys."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensor = obj.detach().to("cpu").contiguous()
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        if ptr in seen:  # safetensors refuses two tensors on one storage
            tensor = tensor.clone()
        elif ptr is not None:
            seen.add(ptr)
        tensors[key] = tensor
        return {_TENSOR: key}
    if isinstance(obj, np.ndarray):  # raw bytes + dtype + shape: exact for every dtype
        key = f"a{len(tensors)}"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(obj).view(np.uint8).reshape(-1).copy())
        return {_ARRAY: key, "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, tuple):
        return {_TUPLE: [_flatten(x, tensors, seen) for x in obj]}
    if isinstance(obj, list):
        return [_flatten(x, tensors, seen) for x in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not _MARKERS & set(obj):
            return {k: _flatten(v, tensors, seen) for k, v in obj.items()}
        return {_ITEMS: [[_flatten(k, tensors, seen), _flatten(v, tensors, seen)] for k, v in obj.items()]}
    raise TypeError(f"trainer state holds a {type(obj).__name__}: only tensors, arrays, numbers, strings, "
                    "lists, tuples and dicts can be saved without pickle")


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_unflatten(x, tensors) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if _TENSOR in obj:
        return tensors[obj[_TENSOR]]
    if _ARRAY in obj:
        raw = tensors[obj[_ARRAY]].numpy()
        return raw.view(np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    if _TUPLE in obj:
        return tuple(_unflatten(x, tensors) for x in obj[_TUPLE])
    if _ITEMS in obj:
        return {_hashable(_unflatten(k, tensors)): _unflatten(v, tensors) for k, v in obj[_ITEMS]}
    return {k: _unflatten(v, tensors) for k, v in obj.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def save_state(state: Any, path: str | os.PathLike) -> None:
    """Write the tree `state` to the safetensors file `path` (tensors as tensors, the rest as JSON)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    tree = _flatten(state, tensors, set())
    with os_errors_of(path):                 # a full disk or a file-size limit: the OSError, one line
        save_file(tensors, str(path), metadata={"format": "archlab-state", "tree": json.dumps(tree)})


def load_state(path: str | os.PathLike) -> Any:
    """The tree `save_state` wrote, tensors on CPU. Raises ValueError for a file that is not one."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != "archlab-state" or "tree" not in metadata:
            raise ValueError(f"{path} is not an archlab trainer state (no state tree in its metadata)")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return _unflatten(json.loads(metadata["tree"]), tensors)


def load_legacy_pickle(path: str | os.PathLike) -> Any:
    """A trainer.pt from archlab before checkpoint format 2, read with `weights_only=True` and an
    explicit allow-list: tensors, containers, numbers and NumPy's RNG-state array, nothing that can
    run code. Raises `pickle.UnpicklingError` for anything outside the list."""
    allowed = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), _numpy_reconstruct()]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True)


def _numpy_reconstruct():
    try:
        from numpy._core.multiarray import _reconstruct  # NumPy 2
    except ImportError:  # NumPy 1.x
        from numpy.core.multiarray import _reconstruct
    return _reconstruct
