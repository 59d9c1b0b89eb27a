"""Device memory that keeps its address across sleep, through the CUDA driver's virtual memory API.

A `StableBuffer` reserves a range of device addresses once and maps physical memory into it only
while awake: `unmap` hands the memory back to the driver (other allocators can use it at once) and
`map` puts fresh memory at the very same addresses. Tensors are views of the range, so a CUDA
graph captured over them stays valid across a sleep; this is what lets the native engine keep its
decode graphs instead of re-capturing every batch-size bucket after each wake (vLLM's sleep mode
does the same with its cuMem allocator).

The driver is reached with ctypes; `supported(device)` says whether this process can use it.
`unmapped_allocator_bytes` says how much of torch's allocator count has no memory behind it now
(vLLM's sleep mode unmaps its pools while their tensors, and so torch's count, stay).
"""

from __future__ import annotations

import ctypes
import functools

import torch

_SUCCESS = 0
_LOCATION_DEVICE = 1
_ALLOCATION_PINNED = 1
_ACCESS_READ_WRITE = 3
_ATTRIBUTE_VMM_SUPPORTED = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_POINTER_ATTRIBUTE_MAPPED = 13  # CU_POINTER_ATTRIBUTE_MAPPED
_NOT_A_DEVICE_POINTER = (1, 500)  # CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_FOUND: reserved addresses, unmapped


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _check(result: int, call: str) -> None:
    if result != _SUCCESS:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"{call} failed: {name.value.decode() if name.value else result}")


def supported(device: torch.device) -> bool:
    """True on a CUDA device whose driver offers virtual memory management."""
    if device.type != "cuda" or _driver() is None:
        return False
    torch.cuda.init()
    ordinal = torch.device(device).index
    ordinal = torch.cuda.current_device() if ordinal is None else ordinal
    value = ctypes.c_int(0)
    if _driver().cuDeviceGetAttribute(ctypes.byref(value), _ATTRIBUTE_VMM_SUPPORTED, ordinal) != _SUCCESS:
        return False
    return value.value == 1


def is_mapped(address: int) -> bool:
    """Whether device memory backs `address` now: False for a reserved range whose memory was unmapped,
    True when the driver says so or gives an answer of another kind (then nothing is left out of a count)."""
    mapped = ctypes.c_int(0)
    result = _driver().cuPointerGetAttribute(ctypes.byref(mapped), _POINTER_ATTRIBUTE_MAPPED, ctypes.c_uint64(address))
    if result in _NOT_A_DEVICE_POINTER:
        return False
    return result != _SUCCESS or bool(mapped.value)


def unmapped_allocator_bytes(device: torch.device) -> tuple[int, int]:
    """(allocated, reserved) bytes that torch's caching allocator counts on `device` in segments with no
    memory behind them now. vLLM's sleep mode allocates weights and KV cache in a torch memory pool of
    its own driver allocations and, asleep, unmaps them while keeping the tensors: torch's allocated,
    reserved and peak bytes still include them although the device holds none of it. (0, 0) off CUDA."""
    if not supported(device):
        return 0, 0
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    allocated = reserved = 0
    for segment in torch.cuda.memory_snapshot():
        if segment["device"] == index and not is_mapped(segment["address"]):
            allocated += segment["allocated_size"]
            reserved += segment["total_size"]
    return allocated, reserved


# Free device memory a wake-up leaves beyond what it maps, for allocations outside PyTorch's cache (cuBLAS, NCCL)
WAKE_HEADROOM_BYTES = 1 << 30


def make_room(device: torch.device, need: int) -> bool:
    """Before `need` bytes are mapped outside PyTorch's caching allocator (an engine waking up): returns PyTorch's
    cached blocks to the driver if what the driver has free would not hold them (with `WAKE_HEADROOM_BYTES` to
    spare); whether it did. When the memory fits, the blocks stay cached, so the next train phase finds the
    blocks of the last one instead of allocating and freeing about its whole peak every step."""
    if need <= 0:
        return False
    if torch.cuda.mem_get_info(device)[0] >= need + WAKE_HEADROOM_BYTES:
        return False
    torch.cuda.empty_cache()
    return True


class _CudaArray:
    """Just enough of `__cuda_array_interface__` for `torch.as_tensor` to view raw device bytes."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


class StableBuffer:
    """`nbytes` of device memory at an address fixed for the buffer's life, mapped only while awake."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device = torch.device(device)
        if not supported(self.device):
            raise RuntimeError(f"{self.device}: the CUDA driver offers no virtual memory management")
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        with torch.cuda.device(self.device):
            torch.empty(1, device=self.device)  # the primary context is current on this thread
        self.prop = _AllocationProp()
        self.prop.type = _ALLOCATION_PINNED
        self.prop.location = _Location(_LOCATION_DEVICE, index)
        granularity = ctypes.c_size_t(0)
        _check(_driver().cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(self.prop), 0),
               "cuMemGetAllocationGranularity")
        self.nbytes = -(-max(nbytes, 1) // granularity.value) * granularity.value
        self.address = ctypes.c_uint64(0)
        _check(_driver().cuMemAddressReserve(ctypes.byref(self.address), ctypes.c_size_t(self.nbytes),
                                             ctypes.c_size_t(granularity.value), ctypes.c_uint64(0),
                                             ctypes.c_uint64(0)), "cuMemAddressReserve")
        self.handle: ctypes.c_uint64 | None = None

    @property
    def mapped(self) -> bool:
        return self.handle is not None

    def map(self) -> None:
        """Backs the address range with fresh device memory (contents undefined)."""
        if self.mapped:
            return
        handle = ctypes.c_uint64(0)
        size = ctypes.c_size_t(self.nbytes)
        _check(_driver().cuMemCreate(ctypes.byref(handle), size, ctypes.byref(self.prop), ctypes.c_uint64(0)),
               f"cuMemCreate of {self.nbytes / 2**30:.2f} GiB on {self.device}")
        try:
            _check(_driver().cuMemMap(self.address, size, ctypes.c_size_t(0), handle, ctypes.c_uint64(0)),
                   "cuMemMap")
            access = _AccessDesc(_Location(_LOCATION_DEVICE, self.device.index), _ACCESS_READ_WRITE)
            _check(_driver().cuMemSetAccess(self.address, size, ctypes.byref(access), ctypes.c_size_t(1)),
                   "cuMemSetAccess")
        except RuntimeError:
            _driver().cuMemUnmap(self.address, size)
            _driver().cuMemRelease(handle)
            raise
        self.handle = handle

    def unmap(self) -> None:
        """Returns the memory to the driver; the addresses stay reserved for the next `map`."""
        if not self.mapped:
            return
        torch.cuda.synchronize(self.device)  # no kernel may still be using it
        _check(_driver().cuMemUnmap(self.address, ctypes.c_size_t(self.nbytes)), "cuMemUnmap")
        _check(_driver().cuMemRelease(self.handle), "cuMemRelease")
        self.handle = None

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor over bytes [offset, offset + size) of the buffer; valid only while mapped."""
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"view of {nbytes} bytes at {offset} outside a buffer of {self.nbytes}")
        raw = torch.as_tensor(_CudaArray(self.address.value + offset, nbytes), device=self.device)
        return raw.view(dtype).view(shape)

    def close(self) -> None:
        if self.address.value:
            self.unmap()
            _check(_driver().cuMemAddressFree(self.address, ctypes.c_size_t(self.nbytes)), "cuMemAddressFree")
            self.address = ctypes.c_uint64(0)

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the driver may already be gone
            pass
