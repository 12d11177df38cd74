"""The shared-memory request bus: fixed slots that carry request payloads to a worker.

The front-end owns the segment. It writes a request's token ids and sampling parameters
into a free slot and sends the worker a small descriptor (slot, generation) over ZeroMQ;
the worker copies the payload out and reports the slot taken, and only then does the
front-end reuse it. Slot ownership is decided by messages, never by flags in shared
memory, so no cross-process memory ordering is relied on.

Layout (little-endian):
    segment header (64 B): magic "GMLXBUS3", num_slots u32, slot_bytes u32, max_tokens u32
    slot i at 64 + i * slot_bytes:
        generation u64, num_tokens u32, num_sampling_bytes u32, num_generated u32,
        the request's ipc.messages.Sampling as msgpack                 (8 KiB in all)
        token ids, int32 x num_tokens
The generation is bumped on every write; the worker checks it before and after copying,
so a descriptor that outlived its slot (a restarted worker, say) is refused, not misread.

Segments are named gmlx_<owner pid>_<owner start time>_<n>. Python's resource tracker
unlinks the owner's segment if the owner dies uncleanly; `reclaim_stale_segments` removes
any left by owners that are gone (a killed resource tracker, a crashed machine's tmpfs).
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
from collections import deque
from multiprocessing import resource_tracker, shared_memory

import msgspec
import numpy as np
import psutil

from ipc.messages import BusPayload, Sampling

logger = logging.getLogger(__name__)

NAME_PREFIX = "gmlx_"
SHM_DIR = "/dev/shm"  # where Linux shows POSIX shared memory; absent on macOS
_MAGIC = b"GMLXBUS3"  # 3: 8 KiB slot headers; a worker reading another layout refuses the segment
_SEGMENT_HEADER = struct.Struct("<8sIII")
_SEGMENT_HEADER_BYTES = 64
_SLOT_HEADER = struct.Struct("<QIII")
_SLOT_HEADER_BYTES = 8192  # the sampling struct takes ~4.8 KB of msgpack at its widest (300 bias and 64 stop ids)
_MAX_SAMPLING_BYTES = _SLOT_HEADER_BYTES - _SLOT_HEADER.size
_sampling_encoder = msgspec.msgpack.Encoder()
_sampling_decoder = msgspec.msgpack.Decoder(Sampling)
_TOKEN_BYTES = 4
_names = itertools.count()
assert _SEGMENT_HEADER.size <= _SEGMENT_HEADER_BYTES and _SLOT_HEADER.size <= _SLOT_HEADER_BYTES


class StaleSlotError(ValueError):
    """The descriptor's generation does not match the slot: the payload is gone."""


class RequestBus:
    """A fixed-slot segment. `create` in the front-end, `attach` in a worker."""

    def __init__(self, shm: shared_memory.SharedMemory, is_owner: bool):
        self._shm = shm
        self.is_owner = is_owner
        magic, self.num_slots, self.slot_bytes, self.max_tokens = _SEGMENT_HEADER.unpack_from(shm.buf, 0)
        if magic != _MAGIC:
            raise ValueError(f"shared memory {shm.name!r} is not a gmlx request bus")
        self._free_slots = deque(range(self.num_slots)) if is_owner else deque()
        self._generations = [0] * self.num_slots

    @property
    def name(self) -> str:
        return self._shm.name

    @classmethod
    def create(cls, num_slots: int = 64, max_tokens: int = 32768) -> "RequestBus":
        assert num_slots > 0 and max_tokens > 0
        slot_bytes = _SLOT_HEADER_BYTES + _TOKEN_BYTES * max_tokens
        slot_bytes = (slot_bytes + 63) // 64 * 64  # cache-line aligned slots
        size_bytes = _SEGMENT_HEADER_BYTES + num_slots * slot_bytes
        proc = psutil.Process()
        name = f"{NAME_PREFIX}{proc.pid}_{_start_tag(proc)}_{next(_names)}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=size_bytes)
        _SEGMENT_HEADER.pack_into(shm.buf, 0, _MAGIC, num_slots, slot_bytes, max_tokens)
        logger.debug("created bus %s: %d slots of %d bytes", name, num_slots, slot_bytes)
        return cls(shm, is_owner=True)

    @classmethod
    def attach(cls, name: str) -> "RequestBus":
        shm = shared_memory.SharedMemory(name=name)
        # Before 3.13 attaching registers the segment with this process's resource tracker,
        # which would unlink the owner's segment when a worker exits. (Attaching in the
        # owner's own process, as tests do, shares the owner's registration: keep it.)
        owner = parse_owner(name)
        if owner is None or owner[0] != os.getpid():
            resource_tracker.unregister(shm._name, "shared_memory")
        return cls(shm, is_owner=False)

    # --- owner side ---

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def write(self, payload: BusPayload) -> tuple[int, int] | None:
        """Copy a payload into a free slot; returns (slot, generation), or None when full."""
        assert self.is_owner
        num_tokens = len(payload.token_ids)
        if num_tokens > self.max_tokens:
            raise ValueError(f"token_ids has {num_tokens} tokens, over the bus limit of {self.max_tokens}")
        sampling = _sampling_encoder.encode(payload.sampling)
        assert len(sampling) <= _MAX_SAMPLING_BYTES, f"sampling takes {len(sampling)} bytes"
        if not self._free_slots:
            return None
        slot = self._free_slots.popleft()
        generation = self._generations[slot] + 1
        self._generations[slot] = generation
        offset = self._slot_offset(slot)
        _SLOT_HEADER.pack_into(self._shm.buf, offset, generation, num_tokens, len(sampling), payload.num_generated)
        self._shm.buf[offset + _SLOT_HEADER.size : offset + _SLOT_HEADER.size + len(sampling)] = sampling
        tokens = np.ndarray((num_tokens,), dtype="<i4", buffer=self._shm.buf,
                            offset=offset + _SLOT_HEADER_BYTES)
        tokens[:] = payload.token_ids
        return slot, generation

    def release(self, slot: int) -> None:
        """Return a slot to the free list once its worker took the payload (or died)."""
        assert self.is_owner and 0 <= slot < self.num_slots
        assert slot not in self._free_slots, f"slot {slot} released twice"
        self._free_slots.append(slot)

    # --- worker side ---

    def read(self, slot: int, generation: int) -> BusPayload:
        """Copy a payload out; raises StaleSlotError if the slot was reused meanwhile."""
        if not 0 <= slot < self.num_slots:
            raise StaleSlotError(f"slot {slot} out of range")
        offset = self._slot_offset(slot)
        header = _SLOT_HEADER.unpack_from(self._shm.buf, offset)
        found_generation, num_tokens, num_sampling_bytes, num_generated = header
        if (found_generation != generation or num_tokens > self.max_tokens
                or num_sampling_bytes > _MAX_SAMPLING_BYTES or num_generated > num_tokens):
            raise StaleSlotError(f"slot {slot} holds generation {found_generation}, not {generation}")
        start = offset + _SLOT_HEADER.size
        sampling_bytes = bytes(self._shm.buf[start : start + num_sampling_bytes])
        token_ids = np.ndarray((num_tokens,), dtype="<i4", buffer=self._shm.buf,
                               offset=offset + _SLOT_HEADER_BYTES).tolist()
        if _SLOT_HEADER.unpack_from(self._shm.buf, offset)[0] != generation:
            raise StaleSlotError(f"slot {slot} was rewritten while being read")
        try:
            sampling = _sampling_decoder.decode(sampling_bytes)
        except msgspec.DecodeError as e:  # only a torn write could do this; the generation check should catch it
            raise StaleSlotError(f"slot {slot} holds no readable sampling parameters: {e}") from None
        return BusPayload(token_ids, sampling, num_generated)

    # --- both ---

    def close(self) -> None:
        """Unmap; the owner also unlinks, so the segment disappears from /dev/shm."""
        self._shm.close()
        if self.is_owner:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass

    def _slot_offset(self, slot: int) -> int:
        return _SEGMENT_HEADER_BYTES + slot * self.slot_bytes


def _start_tag(proc: psutil.Process) -> str:
    """The process start time in centiseconds, hex: tells a reused pid from the owner."""
    return format(int(proc.create_time() * 100), "x")


def parse_owner(name: str) -> tuple[int, str] | None:
    """(pid, start tag) of a bus segment name, or None if it is not one."""
    if not name.startswith(NAME_PREFIX):
        return None
    parts = name[len(NAME_PREFIX):].split("_")
    if len(parts) != 3 or not parts[0].isdigit():
        return None
    return int(parts[0]), parts[1]


def is_owner_alive(pid: int, start_tag: str) -> bool:
    try:
        return _start_tag(psutil.Process(pid)) == start_tag
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True  # someone else's live process: not ours to judge


def list_segments() -> list[str]:
    """Bus segment names currently in /dev/shm (empty where /dev/shm does not exist)."""
    if not os.path.isdir(SHM_DIR):
        return []
    return sorted(name for name in os.listdir(SHM_DIR) if parse_owner(name) is not None)


def reclaim_stale_segments() -> list[str]:
    """Unlink bus segments whose owner process is gone; returns the names removed."""
    removed = []
    for name in list_segments():
        pid, start_tag = parse_owner(name)
        if is_owner_alive(pid, start_tag):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
            logger.info("reclaimed stale bus segment %s (owner pid %d is gone)", name, pid)
        except FileNotFoundError:
            pass
    return removed
