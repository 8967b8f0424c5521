"""The array libraries the CUDA kernels take: how each one is checked, flattened,
allocated, given its stream and handed to numba (NumPy host arrays, CuPy, torch).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from linattn_numba.gpu import target

__all__ = ["LIBRARIES", "CuPyLibrary", "Library", "NumPyLibrary", "TorchLibrary"]


class Library:
    name = ""

    def is_array(self, x: Any) -> bool:
        raise NotImplementedError

    def device_id(self, x: Any) -> int | None:
        """The CUDA device ordinal of ``x``, or ``None`` if it is not on a CUDA device."""
        raise NotImplementedError

    def prepare(self, x: Any, shape: tuple[int, ...], dtype: str) -> Any:
        """``x`` reshaped to ``shape``, cast to ``dtype``, C-contiguous (copies only if needed)."""
        raise NotImplementedError

    def copy(self, x: Any, shape: tuple[int, ...], dtype: str) -> Any:
        """A fresh, writable, C-contiguous copy (kernels write into it)."""
        raise NotImplementedError

    def empty(self, shape: tuple[int, ...], dtype: str, device: int | None) -> Any:
        raise NotImplementedError

    def zeros(self, shape: tuple[int, ...], dtype: str, device: int | None) -> Any:
        raise NotImplementedError

    def view(self, x: Any) -> Any:
        """The numba device array seeing ``x``'s memory."""
        return target.as_device_array(x)

    def stream(self, device: int | None) -> Any:
        raise NotImplementedError

    def result(self, x: Any, shape: tuple[int, ...]) -> Any:
        return x.reshape(shape)


class NumPyLibrary(Library):
    """Host arrays, copied to the device and back (for the simulator and tests)."""

    name = "numpy"

    def is_array(self, x: Any) -> bool:
        return isinstance(x, np.ndarray)

    def device_id(self, x: Any) -> int | None:
        return 0

    def prepare(self, x: Any, shape: tuple[int, ...], dtype: str) -> Any:
        return target.to_device(np.ascontiguousarray(np.reshape(x, shape), dtype=dtype))

    def copy(self, x: Any, shape: tuple[int, ...], dtype: str) -> Any:
        return self.prepare(x, shape, dtype)

    def empty(self, shape: tuple[int, ...], dtype: str, device: int | None) -> Any:
        return target.device_array(shape, np.dtype(dtype))

    def zeros(self, shape: tuple[int, ...], dtype: str, device: int | None) -> Any:
        return target.to_device(np.zeros(shape, dtype=dtype))

    def view(self, x: Any) -> Any:
        return x

    def stream(self, device: int | None) -> Any:
        return 0

    def result(self, x: Any, shape: tuple[int, ...]) -> Any:
        return x.copy_to_host().reshape(shape)


class CuPyLibrary(Library):
    name = "cupy"

    def is_array(self, x: Any) -> bool:
        import cupy

        return isinstance(x, cupy.ndarray)

    def device_id(self, x: Any) -> int | None:
        return int(x.device.id)

    def prepare(self, x: Any, shape: tuple[int, ...], dtype: str) -> Any:
        import cupy

        return cupy.ascontiguousarray(x.reshape(shape), dtype=dtype)

    def copy(self, x: Any, shape: tuple[int, ...], dtype: str) -> Any:
        import cupy

        return cupy.array(x.reshape(shape), dtype=dtype, order="C", copy=True)

    def empty(self, shape: tuple[int, ...], dtype: str, device: int | None) -> Any:
        import cupy

        with cupy.cuda.Device(device):
            return cupy.empty(shape, dtype=dtype)

    def zeros(self, shape: tuple[int, ...], dtype: str, device: int | None) -> Any:
        import cupy

        with cupy.cuda.Device(device):
            return cupy.zeros(shape, dtype=dtype)

    def stream(self, device: int | None) -> Any:
        import cupy

        with cupy.cuda.Device(device):
            return target.external_stream(cupy.cuda.get_current_stream().ptr)


class TorchLibrary(Library):
    name = "torch"

    def is_array(self, x: Any) -> bool:
        import torch

        return isinstance(x, torch.Tensor)

    def device_id(self, x: Any) -> int | None:
        return int(x.get_device()) if x.device.type == "cuda" else None

    def _dtype(self, dtype: str) -> Any:
        import torch

        return getattr(torch, dtype)

    def prepare(self, x: Any, shape: tuple[int, ...], dtype: str) -> Any:
        return x.detach().reshape(shape).to(self._dtype(dtype)).contiguous()

    def copy(self, x: Any, shape: tuple[int, ...], dtype: str) -> Any:
        return x.detach().reshape(shape).to(self._dtype(dtype), copy=True).contiguous()

    def empty(self, shape: tuple[int, ...], dtype: str, device: int | None) -> Any:
        import torch

        return torch.empty(shape, dtype=self._dtype(dtype), device=f"cuda:{device}")

    def zeros(self, shape: tuple[int, ...], dtype: str, device: int | None) -> Any:
        import torch

        return torch.zeros(shape, dtype=self._dtype(dtype), device=f"cuda:{device}")

    def stream(self, device: int | None) -> Any:
        import torch

        return target.external_stream(torch.cuda.current_stream(device).cuda_stream)


#: The libraries by name (``"numpy"``, ``"cupy"``, ``"torch"``).
LIBRARIES: dict[str, Library] = {
    lib.name: lib for lib in (NumPyLibrary(), CuPyLibrary(), TorchLibrary())
}
