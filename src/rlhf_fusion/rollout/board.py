"""The trigger board of a group's rollouts: every rank's unfinished count, heartbeat and the
trigger.

Inter-stage fusion migrates when at most R_t samples are still decoding over all ranks, so each
rank must learn the others' counts while it decodes. Through the c10d store that is a round
trip to rank 0's process per read (0.1-0.2 ms, more on a loaded CPU), which is why the store
board reads only every ``report_every`` steps and the trigger lands late: on short completions
the whole generation is a few dozen steps of about a millisecond each.

When every rank of the group runs on one host (one node, the common case), they share a small
file in ``/dev/shm`` instead: a read or a write is a memory access, so every rank publishes
and checks after every decode step and the trigger fires on the step it should. The board
lives as long as the group and serves every rollout, each under its own sequence number: a
rollout starts without any collective or store traffic, as the serial one does. A count
written under an older number is a rank that has not started this rollout yet; it counts as
its whole shard. Each count and the trigger are one 64-bit word, sequence number and value
together, so a reader never pairs one rollout's number with another's value. Every slot has
one writer (its rank), except the trigger, which any rank may set: whichever sets it, every
rank stops at its next check. Ranks on several hosts poll the c10d store
(:mod:`rlhf_fusion.rollout.distributed`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import uuid
from collections.abc import Sequence

_WORD = struct.Struct("<q")
_VALUE_BITS = 32
_VALUE_MASK = (1 << _VALUE_BITS) - 1
NO_TRIGGER = -1


def shm_dir() -> str | None:
    """``/dev/shm`` where the kernel offers it. Not a temporary directory instead: one on a
    network file system would look shared to ranks on other hosts without being coherent."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


_PREFIX = "rlhf_fusion_board_"


def sweep(where: str) -> None:
    """Remove the messages a killed job left beside its board (a rank that died before its
    clean-up): every name carries the pid of the rank that created the board, and a board
    whose creator is gone has no reader left."""
    for name in os.listdir(where):
        if not name.startswith(_PREFIX):
            continue
        try:
            pid = int(name[len(_PREFIX):].split("_", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(where, name))
        except (ValueError, PermissionError):
            pass


class SharedBoard:
    """The board in a shared file: words ``[count x world][heartbeat x world][pid x world]
    [done x world][pushed x world][hungry x world][trigger]``; a count is
    ``seq << 32 | unfinished``, a pushed word ``seq << 32 | chunks`` (the stream chunks a
    destination has written so far), a done word ``seq << 32 | chunks + 1`` once it will
    write no more (the final count in the same word, so no reader pairs "done" with an older
    count; the serial rollout's barrier sets it too), a hungry word ``seq << 32 | 1`` once a
    rank waits for the stream, the trigger ``seq << 32 | rank + 1``. The pids let a rank tell at once that a peer on its host has
    died (:meth:`alive`)."""

    def __init__(self, path: str, world: int, rank: int, *, create: bool) -> None:
        self.path = path
        self.world = world
        self.rank = rank
        size = _WORD.size * (6 * world + 1)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)   # zeros: sequence number 0, before any rollout
            self.buf = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.seq = 0
        self.shards: list[int] = [0] * world
        # This rank's newest message that peers may still read (the rollout's final
        # exchange): removed by the next one, or at exit (:meth:`remove_last_message`).
        self.last_message: str | None = None
        self._beats = 0
        self._put(2 * world + rank, os.getpid())

    @classmethod
    def create(cls, world: int, rank: int) -> SharedBoard | None:
        """A new board under a unique name, or None without ``/dev/shm``."""
        where = shm_dir()
        if where is None:
            return None
        sweep(where)
        path = os.path.join(where, f"{_PREFIX}{os.getpid()}_{uuid.uuid4().hex}")
        try:
            return cls(path, world, rank, create=True)
        except OSError:
            return None

    @classmethod
    def attach(cls, path: str, world: int, rank: int) -> SharedBoard | None:
        """The board another rank created, or None when this rank cannot open it: it runs on
        another host or in another mount namespace (the name is unique, so a file that opens
        is that board)."""
        if not path:
            return None
        try:
            return cls(path, world, rank, create=False)
        except OSError:
            return None

    def unlink(self) -> None:
        """Remove the name once every rank has mapped the board; the mappings stay valid, and
        nothing is left in /dev/shm if a rank dies later."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _put(self, slot: int, value: int) -> None:
        _WORD.pack_into(self.buf, slot * _WORD.size, value)

    def _get(self, slot: int) -> int:
        return _WORD.unpack_from(self.buf, slot * _WORD.size)[0]

    def begin(self, shards: Sequence[int]) -> None:
        """The next rollout, where rank ``i`` starts with ``shards[i]`` samples to decode.
        Every rank of the group calls it once per rollout, so their numbers agree."""
        if len(shards) != self.world:
            raise ValueError(f"{len(shards)} shard sizes for a board of {self.world} ranks")
        self.seq += 1
        self.shards = list(shards)
        self.publish(self.shards[self.rank])

    def publish(self, unfinished: int) -> None:
        """This rank's count in this rollout, and a heartbeat (every publish is one)."""
        self._put(self.rank, self.seq << _VALUE_BITS | unfinished)
        self.beat()

    def beat(self) -> None:
        self._beats += 1
        self._put(self.world + self.rank, self._beats)

    def set_pushed(self, chunks: int) -> None:
        self._put(4 * self.world + self.rank, self.seq << _VALUE_BITS | chunks)

    def pushed(self, rank: int) -> int:
        """The stream chunks ``rank`` has written in this rollout so far."""
        word = self._get(4 * self.world + rank)
        return word & _VALUE_MASK if word >> _VALUE_BITS == self.seq else 0

    def set_done(self, chunks: int = 0) -> None:
        """This rank writes no more stream chunks in this rollout than ``chunks``."""
        self._put(3 * self.world + self.rank, self.seq << _VALUE_BITS | chunks + 1)

    def done(self, rank: int) -> int | None:
        """``rank``'s final chunk count once its generation in this rollout is over."""
        word = self._get(3 * self.world + rank)
        return (word & _VALUE_MASK) - 1 if word >> _VALUE_BITS == self.seq else None

    def set_hungry(self) -> None:
        """This rank has scored its own samples and waits for the stream's."""
        self._put(5 * self.world + self.rank, self.seq << _VALUE_BITS | 1)

    def any_hungry(self) -> bool:
        """Whether another rank waits for the stream in this rollout (a destination holds its
        finished samples back until one does; its own hunger is no reason to push them)."""
        return any(self._get(5 * self.world + i) >> _VALUE_BITS == self.seq
                   for i in range(self.world) if i != self.rank)

    def counts(self) -> list[int]:
        """Every rank's unfinished count in this rollout (its shard if it has not started)."""
        out = []
        for i in range(self.world):
            word = self._get(i)
            out.append(word & _VALUE_MASK if word >> _VALUE_BITS == self.seq else self.shards[i])
        return out

    def total(self) -> int:
        return sum(self.counts())

    def heartbeats(self) -> list[int]:
        return [self._get(self.world + i) for i in range(self.world)]

    def trigger(self) -> int:
        """The rank that set this rollout's trigger, or :data:`NO_TRIGGER`."""
        word = self._get(6 * self.world)
        return (word & _VALUE_MASK) - 1 if word >> _VALUE_BITS == self.seq else NO_TRIGGER

    def set_trigger(self) -> None:
        self._put(6 * self.world, self.seq << _VALUE_BITS | self.rank + 1)

    def claim_trigger(self, counts: Sequence[int]) -> None:
        """Set the trigger together with the ``counts`` it was set on and this rank, the
        claimer, which every rank then reads (:meth:`trigger_claim`) to agree on the
        migration's roles without another message. Two ranks may see the total fall to R_t at
        once and both set the trigger; the counts file is published by a hard link, which
        fails if it exists, so the first claim is the rollout's on every rank. Written before
        the trigger word: a rank that sees the word finds the file."""
        path = self.mailbox(f"t{self.seq}")
        part = f"{path}.part{self.rank}"
        with open(part, "wb") as f:
            f.write(struct.pack(f"<{len(counts) + 1}q", *counts, self.rank))
        try:
            os.link(part, path)
        except FileExistsError:
            pass   # another rank claimed first: its claim holds
        finally:
            os.unlink(part)
        self.set_trigger()

    def trigger_claim(self) -> tuple[list[int], int] | None:
        """The counts this rollout's trigger was claimed on and the rank that claimed it, or
        None (no claim: the trigger was set by :meth:`set_trigger`, or not yet)."""
        try:
            with open(self.mailbox(f"t{self.seq}"), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        *counts, claimer = struct.unpack(f"<{len(data) // _WORD.size}q", data)
        return counts, claimer

    def remove_trigger_claim(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.mailbox(f"t{self.seq}"))

    def alive(self, rank: int) -> bool:
        """Whether rank ``rank``'s process still exists (it is on this host)."""
        pid = self._get(2 * self.world + rank)
        if pid <= 0:
            return True   # not attached yet: nothing to say
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def mailbox(self, name: str) -> str:
        """A path for a message between this board's ranks (``name`` unique per rollout,
        e.g. ``f"m{seq}.{src}.{dst}"``): next to the board, in the same /dev/shm."""
        return f"{self.path}.{name}"

    def remove_last_message(self) -> None:
        if self.last_message is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.last_message)
            self.last_message = None

    def close(self) -> None:
        self.remove_last_message()
        self.buf.close()
