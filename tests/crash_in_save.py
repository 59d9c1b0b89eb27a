"""`torchrun ... tests/crash_in_save.py N --config ...`: rl.main, but rank 1 dies with SIGKILL in the middle of
writing the checkpoint of rollout N (its shards written, the folder not yet renamed).
`torchrun ... tests/crash_in_save.py full:N --config ...`: the disk fills as rank 1 writes its shards of rollout N:
each file it opens there is created, and closing it fails with ENOSPC, as a buffered write to a full disk does."""

import errno
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.distributed.checkpoint.filesystem import FileSystem  # noqa: E402

from rl import launch, main
from rl.run import checkpoint  # noqa: E402


def save_then_die_on_rank_1(crash_at: int, dcp_save):
    def save(state, storage_writer):
        dcp_save(state, storage_writer=storage_writer)
        if os.environ.get("RANK") == "1" and f".rollout_{crash_at}.tmp" in str(storage_writer.path):
            os.kill(os.getpid(), signal.SIGKILL)

    return save


def disk_full_on_rank_1(full_at: int, create_stream):
    @contextmanager
    def create(self, path, mode):
        with create_stream(self, path, mode) as stream:
            yield stream
        if os.environ.get("RANK") == "1" and f".rollout_{full_at}.tmp" in str(path) and "w" in mode:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    return create


if __name__ == "__main__":
    how, _, at = sys.argv.pop(1).rpartition(":")
    if how == "full":
        FileSystem.create_stream = disk_full_on_rank_1(int(at), FileSystem.create_stream)
    else:
        checkpoint.dcp.save = save_then_die_on_rank_1(int(at), checkpoint.dcp.save)
    sys.exit(launch.cli(main.main, sys.argv[1:]))
