"""AdamW with its moments in host memory (`train.optimizer_offload`): what lets a model whose fp32 training state
does not fit one device train there (7B full-parameter on one H200: 28 GB of parameters and 28 GB of gradients stay
on the device, the 56 GB of moments live in pinned host memory).

Each step streams the moments through the device in fixed-size chunks of elements: while the update of chunk i
runs on the compute stream, the moments of chunk i+1 come in on one copy stream and those of chunk i-1 go back on
another, through two pairs of device buffers. The update is torch's own AdamW kernel (fused on CUDA) on the
chunk's slices of the parameters, gradients and moments, so the numbers are those of `torch.optim.AdamW`; only
where the moments live differs. Chunks cut parameters at element boundaries (AdamW is elementwise), so the
device holds 4 x chunk_elements x 4 bytes at most, whatever the largest parameter.

The state keeps AdamW's layout (`step`, `exp_avg`, `exp_avg_sq`, as DTensors of the parameters' placement), so
checkpoints load into either optimizer: a run may resume with the moments offloaded or not. Off CUDA the same
chunked path runs with synchronous copies (the host is the device).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as adamw_update

CHUNK_ELEMENTS = 1 << 26  # 256 MB of fp32 per buffer; 1 GB of device buffers in all
MOMENTS = ("exp_avg", "exp_avg_sq")


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def like_param(host: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`host` (the parameter's local shape) wrapped as the parameter is: a DTensor of its placement, or itself."""
    if isinstance(param, DTensor):  # same spec, new local tensor (from_local would move it to the mesh's device)
        return DTensor(host, param._spec, requires_grad=False)
    return host


class HostAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose `exp_avg` / `exp_avg_sq` live in (pinned) host memory and stream through the
    device in chunks of `chunk_elements` at each step. No amsgrad, no maximize, no complex parameters."""

    keeps_state_on_host = True

    def __init__(self, params, chunk_elements: int = CHUNK_ELEMENTS, **kwargs):
        kwargs.pop("fused", None)
        kwargs.pop("foreach", None)
        super().__init__(params, **kwargs)
        if any(g["amsgrad"] or g["maximize"] for g in self.param_groups):
            raise ValueError("HostAdamW supports neither amsgrad nor maximize")
        self.chunk_elements = chunk_elements
        self.arena = PinnedArena()
        if torch.cuda.is_available():  # every moment's buffer in one block of exactly their size
            self.arena.reserve(sum(2 * PinnedArena.aligned(local(p).numel() * 4)
                                   for group in self.param_groups for p in group["params"]))

    # ------------------------------------------------------------------------ state

    def _host_zeros(self, param: torch.Tensor) -> torch.Tensor:
        p = local(param)
        host = self.arena.take(p.shape, torch.float32) if torch.cuda.is_available() else torch.empty(p.shape)
        return like_param(host.zero_(), param)

    def _state_of(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = self._host_zeros(param)
            state["exp_avg_sq"] = self._host_zeros(param)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads into the host buffers the moments already have (a resume allocates no second copy, and torch's
        loader, which would move every moment to its parameter's device first, never sees them)."""
        held = {param: {k: state[k] for k in MOMENTS if k in state} for param, state in self.state.items()}
        moments = {pid: {k: state[k] for k in MOMENTS if k in state} for pid, state in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": {
            pid: {k: torch.empty(0) if k in MOMENTS else v for k, v in state.items()}
            for pid, state in state_dict["state"].items()}})
        ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        params = [param for group in self.param_groups for param in group["params"]]
        for pid, param in zip(ids, params):
            state = self.state[param]
            for key, value in moments.get(pid, {}).items():
                host = held.get(param, {}).get(key)
                if host is None:
                    host = self._host_zeros(param)
                if local(host).data_ptr() != local(value).data_ptr():  # else loaded in place (checkpoint.load)
                    local(host).copy_(local(value))
                state[key] = host
            if torch.is_tensor(state.get("step")):  # a fused optimizer's step lives on the device
                state["step"] = state["step"].detach().to("cpu", torch.float32, copy=True)

    # ------------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._group_step(group, params)
        return loss

    def _group_step(self, group: dict, params: list[torch.Tensor]) -> None:
        device = local(params[0]).device
        states = [self._state_of(p) for p in params]
        chunks = list(element_chunks([local(p).numel() for p in params], self.chunk_elements))
        width = max(sum(b - a for _, a, b in chunk) for chunk in chunks)
        stream = ChunkStream(device, width)
        host = lambda chunk: [(local(states[i]["exp_avg"]), local(states[i]["exp_avg_sq"]), a, b)  # noqa: E731
                              for i, a, b in chunk]
        flat = lambda t, a, b: local(t).view(-1)[a:b]  # noqa: E731
        stream.load(0, host(chunks[0]))
        for k, chunk in enumerate(chunks):
            if k + 1 < len(chunks):
                stream.load(k + 1, host(chunks[k + 1]))  # the next chunk comes in while this one updates
            m, v = stream.ready(k)
            # torch's update counts the step itself: it gets a copy per slice (a parameter may span chunks)
            steps = [states[i]["step"].to(device, copy=True) for i, _, _ in chunk]
            adamw_update(
                [flat(params[i], a, b) for i, a, b in chunk], [flat(params[i].grad, a, b) for i, a, b in chunk],
                m, v, [], steps,
                fused=device.type == "cuda", foreach=None if device.type == "cuda" else False,
                amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
            stream.store(k)
        stream.finish()
        for state in states:
            state["step"] += 1


def element_chunks(sizes: list[int], width: int):
    """Cuts the concatenated elements of tensors of `sizes` into runs of at most `width`: each run is a list of
    (tensor index, start, end) slices."""
    chunk, used = [], 0
    for i, size in enumerate(sizes):
        start = 0
        while start < size:
            take = min(size - start, width - used)
            chunk.append((i, start, start + take))
            used, start = used + take, start + take
            if used == width:
                yield chunk
                chunk, used = [], 0
    if chunk:
        yield chunk


class ChunkStream:
    """Two pairs of device buffers through which chunks of host moments come in (`load`), are updated on the
    compute stream (`ready` hands out the device views) and go back (`store`). On CUDA the copies run on their
    own streams, ordered by events: a buffer is refilled only once its previous chunk is back in host memory."""

    def __init__(self, device: torch.device, width: int):
        self.device = device
        self.cuda = device.type == "cuda"
        self.buffers = [torch.empty(2, width, device=device) for _ in range(2)]
        self.slices: dict[int, list] = {}
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.h2d, self.d2h = torch.cuda.Stream(device), torch.cuda.Stream(device)
            # the buffers come from the compute stream's pool: the copies wait for what it ran before
            self.h2d.wait_stream(self.compute)
            self.loaded = [torch.cuda.Event() for _ in range(2)]
            self.stored = [torch.cuda.Event() for _ in range(2)]
            self.updated = [torch.cuda.Event() for _ in range(2)]

    def _views(self, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        buf, ms, vs, at = self.buffers[k % 2], [], [], 0
        for _, _, a, b in self.slices[k]:
            ms.append(buf[0, at : at + b - a])
            vs.append(buf[1, at : at + b - a])
            at += b - a
        return ms, vs

    def _pairs(self, k: int):
        """(host slice, device view) of chunk k's moments, exp_avg's then exp_avg_sq's."""
        ms, vs = self._views(k)
        for (m, v, a, b), dm, dv in zip(self.slices[k], ms, vs):
            yield m.view(-1)[a:b], dm
            yield v.view(-1)[a:b], dv

    def _on(self, stream):
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def load(self, k: int, slices: list[tuple[torch.Tensor, torch.Tensor, int, int]]) -> None:
        self.slices[k] = slices
        if self.cuda:
            self.h2d.wait_event(self.stored[k % 2])  # the buffer's last chunk is back in host memory
        with self._on(self.cuda and self.h2d):
            for host, device in self._pairs(k):
                device.copy_(host, non_blocking=self.cuda)
        if self.cuda:
            self.loaded[k % 2].record(self.h2d)

    def ready(self, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self.cuda:
            self.compute.wait_event(self.loaded[k % 2])
        return self._views(k)

    def store(self, k: int) -> None:
        if self.cuda:
            self.updated[k % 2].record(self.compute)
            self.d2h.wait_event(self.updated[k % 2])
        with self._on(self.cuda and self.d2h):
            for host, device in self._pairs(k):
                host.copy_(device, non_blocking=self.cuda)
        if self.cuda:
            self.stored[k % 2].record(self.d2h)
        del self.slices[k]

    def finish(self) -> None:
        """Every moment back in host memory before the step returns (a checkpoint may read them next)."""
        if self.cuda:
            self.d2h.synchronize()


class PinnedArena:
    """Pinned host buffers cut from a few large blocks of page-locked memory. torch's pinned allocator rounds each
    request up to a power of two (up to 2x the host memory); here each block is ordinary host memory of the exact
    size asked for, registered with the CUDA driver (cudaHostRegister), so copies from and to it run at
    copy-engine speed as from any pinned memory. Whoever knows the total up front `reserve`s one block of it (at
    7B AdamW's moments take 60.9 GB, not the 73 GB that 1 GiB power-of-two blocks cost them); a buffer goes into
    the first block with room for it. Blocks live as long as the arena."""

    BLOCK_BYTES = 1 << 30
    ALIGN = 512

    def __init__(self):
        self.blocks: list[list] = []  # [block, bytes used]

    @classmethod
    def aligned(cls, nbytes: int) -> int:
        return -(-nbytes // cls.ALIGN) * cls.ALIGN

    def reserve(self, nbytes: int) -> None:
        """A block of `nbytes` for the buffers to come (their aligned sizes summed)."""
        if nbytes > 0:
            self.blocks.append([self.new_block(nbytes), 0])

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        nbytes = shape.numel() * dtype.itemsize
        entry = next((e for e in self.blocks if e[1] + nbytes <= e[0].numel()), None)
        if entry is None:
            self.reserve(max(self.BLOCK_BYTES, self.aligned(nbytes)))
            entry = self.blocks[-1]
        block, used = entry
        entry[1] = used + self.aligned(nbytes)  # keep every buffer aligned
        return block[used : used + nbytes].view(dtype).view(shape)

    def block_bytes(self) -> int:
        return sum(block.numel() for block, _ in self.blocks)

    @staticmethod
    def new_block(size: int) -> torch.Tensor:
        block = torch.empty(size, dtype=torch.uint8)
        if torch.cuda.is_available():
            error = torch.cuda.cudart().cudaHostRegister(block.data_ptr(), size, 0)
            if int(error) != 0:
                raise RuntimeError(f"cudaHostRegister of {size / 1e9:.1f} GB of host memory failed ({error})")
            block.registered = True
        return block

    def __del__(self):
        for block, _ in self.blocks:  # views that outlive the arena keep working, as pageable memory
            if getattr(block, "registered", False):
                torch.cuda.cudart().cudaHostUnregister(block.data_ptr())
