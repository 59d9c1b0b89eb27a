"""`torchrun ... tests/crash_in_save.py N --config ...`: rl.main, but rank 1 dies with SIGKILL in the middle of
writing the checkpoint of rollout N (its shards written, the folder not yet renamed)."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl import checkpoint, launch, main  # noqa: E402



def save_then_die_on_rank_1(crash_at: int, dcp_save):
    def save(state, storage_writer):
        dcp_save(state, storage_writer=storage_writer)
        if os.environ.get("RANK") == "1" and f".rollout_{crash_at}.tmp" in str(storage_writer.path):
            os.kill(os.getpid(), signal.SIGKILL)

    return save


if __name__ == "__main__":
    checkpoint.dcp.save = save_then_die_on_rank_1(int(sys.argv.pop(1)), checkpoint.dcp.save)
    sys.exit(launch.cli(main.main, sys.argv[1:]))
