"""A local Hugging Face checkpoint directory: ``config.json`` and safetensors files, read with the
``safetensors`` package (no hub access).

``Checkpoint(path)`` reads the config and every file's header (names, shapes, dtypes) up front;
``check(expected)`` compares the tensors a model needs with what is there and raises one
``ValueError`` listing every missing tensor and every wrong shape, before any tensor is read, so
a bad checkpoint never leaves a model half-loaded (a quantized one is read by
``dualop.models.quantized``, from the same header). ``get(name, framework)`` then reads one tensor
as a torch tensor (``"pt"``), a jax array (``"flax"``) or a numpy array (``"numpy"``), in the
checkpoint's dtype.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["Checkpoint", "CheckpointError", "QUANTIZED_DTYPES"]

# safetensors dtypes that hold quantized weights or their packed codes (float8, 4/6-bit floats,
# integers up to 32 bits); int64 and bool tensors are buffers (ids, masks) in float checkpoints too.
QUANTIZED_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "I8", "U8", "I16", "U16",
                              "I32", "U32"})


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded: missing files, tensors or wrong shapes."""


class Checkpoint:
    """The config and tensor index of a checkpoint directory (see the module docstring)."""

    def __init__(self, path: str | os.PathLike) -> None:
        from safetensors import safe_open

        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise CheckpointError(f"from_pretrained: {self.path!r} is not a directory (a local checkpoint "
                                  "directory with config.json and *.safetensors is expected; nothing is downloaded)")
        config_path = os.path.join(self.path, "config.json")
        if not os.path.isfile(config_path):
            raise CheckpointError(f"from_pretrained: {self.path!r} has no config.json")
        with open(config_path) as f:
            self.config: dict[str, Any] = json.load(f)
        files = sorted(name for name in os.listdir(self.path) if name.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"from_pretrained: {self.path!r} has no *.safetensors file "
                                  "(save the model with safe_serialization, the default)")
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        self._file_of: dict[str, str] = {}
        for name in files:
            file = os.path.join(self.path, name)
            with safe_open(file, framework="numpy") as f:
                for key in f.keys():
                    view = f.get_slice(key)
                    self.shapes[key] = tuple(int(d) for d in view.get_shape())
                    self.dtypes[key] = str(view.get_dtype())
                    self._file_of[key] = file
        self._handles: dict[tuple[str, str], Any] = {}

    def check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        """Raise a ``CheckpointError`` naming every tensor of ``expected`` ({name: shape}) that is
        missing or has another shape."""
        missing = [name for name in expected if name not in self.shapes]
        wrong = [f"{name}: shape {self.shapes[name]}, expected {tuple(shape)}"
                 for name, shape in expected.items() if name in self.shapes and self.shapes[name] != tuple(shape)]
        if not missing and not wrong:
            return
        lines = [f"from_pretrained: the checkpoint {self.path!r} does not match its config.json "
                 f"({self.config.get('architectures', ['?'])[0]}); nothing was loaded"]
        if missing:
            lines.append(f"missing tensors ({len(missing)}): " + ", ".join(missing[:8])
                         + (" ..." if len(missing) > 8 else ""))
        if wrong:
            lines.append(f"tensors of the wrong shape ({len(wrong)}): " + "; ".join(wrong[:8])
                         + (" ..." if len(wrong) > 8 else ""))
        raise CheckpointError("\n  ".join(lines))

    def get(self, name: str, framework: str) -> Any:
        """Tensor ``name`` as ``framework``'s array ("pt": torch, "flax": jax, "numpy"), checkpoint dtype."""
        from safetensors import safe_open

        file = self._file_of[name]
        if framework != "pt" and self.dtypes[name] in _ML_DTYPES:
            return _read_ml_dtype(file, name, self.dtypes[name], framework)
        handle = self._handles.get((file, framework))
        if handle is None:
            handle = self._handles[(file, framework)] = safe_open(file, framework=framework)
        return handle.get_tensor(name)

    def close(self) -> None:
        """Drop the open file handles (the tensors already read stay valid)."""
        self._handles.clear()


# safetensors dtypes numpy has no type of its own for: read through ml_dtypes' (jax's) types, since
# safetensors' numpy and flax readers cannot convert them.
_ML_DTYPES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}


def _read_ml_dtype(file: str, name: str, dtype: str, framework: str) -> Any:
    """Tensor ``name`` of a safetensors ``file`` read from its bytes (the format: an 8-byte
    little-endian header length, a JSON header of dtypes, shapes and data offsets, the data)."""
    import ml_dtypes
    import numpy as np

    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(header_len))[name]
        begin, end = entry["data_offsets"]
        f.seek(8 + header_len + begin)
        raw = f.read(end - begin)
    array = np.frombuffer(raw, dtype=getattr(ml_dtypes, _ML_DTYPES[dtype])).reshape(entry["shape"])
    if framework == "flax":
        import jax.numpy as jnp

        return jnp.asarray(array)
    return array.copy()
