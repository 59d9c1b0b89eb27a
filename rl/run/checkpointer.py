"""The run's folder and its checkpoints, over the run's stateful parts: the learner (policy, optimizer,
schedules, critic), the data cursor, the health counters and the groups in flight (partial rollouts,
max_staleness); every rank's RNG states ride along.

`RunCheckpointer(cfg, dist, restarted)` claims the folder first, before anything expensive: it locks it,
checks that it can write there, and decides what to resume from (refusing to write over a run silently).
The run adds each stateful part where it builds it (`learner`, whose models go into the sharded tensors;
`parts`, name -> an object with state_dict / load_state_dict); `resume()` restores them and says where the loop
goes on; only then does a resumed run write in the folder (the config, kept beside the earlier one when keys
changed; newer checkpoints set aside when it branches from an older one), so a refused resume leaves the
folder as it was. `maybe_save()` saves on the interval, after the last rollout and when the run is asked to
stop; `export()` writes the finished run's policy beside its checkpoints. The format on disk is
rl/run/checkpoint.py's.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from rl import parallel
from rl.config import Config, ConfigError, dump
from rl.parallel import print0
from rl.rollout.buffer import resume_problem
from rl.run import checkpoint
from rl.run.export import export_adapter, export_policy
from rl.run.metrics import keep_rows_before, read_metric_rows
from rl.run.safe_load import error_line
from rl.train.learner import Learner


class RunCheckpointer:
    def __init__(self, cfg: Config, dist: parallel.Dist, restarted: bool):
        self.cfg, self.dist, self.restarted = cfg, dist, restarted
        self.hf_sources = [Path(cfg.model.path), Path(cfg.model.tokenizer or cfg.model.path)]
        self.lock, self.candidates = claim_output_dir(cfg, dist, restarted)
        self.loaded: tuple[Path, checkpoint.TrainerState] | None = None
        self.learner: Learner | None = None  # its models and optimizers (sharded) and its schedules
        # The run's other stateful parts by name, each added where it is built (None: this run has no such part, and
        # a checkpoint's state of it stays unread).
        self.parts: dict[str, checkpoint.Stateful | None] = {}

    def models(self) -> checkpoint.Models:
        critic = self.learner.critic_state
        return {"model": (self.learner.policy, self.learner.optimizer), **({"critic": critic} if critic else {})}

    def resume(self) -> tuple[int, int]:
        """Restores every part from the newest readable checkpoint; returns (the next rollout, weight_version):
        (0, 1) for a fresh run, whose first push is version 1."""
        if not self.candidates:
            return 0, 1
        start = time.perf_counter()
        schedules = self.learner.state_dict().keys()
        path, state = checkpoint.load_newest(self.candidates, self.models())
        self.learner.load_state_dict({name: state.parts.get(name) for name in schedules}, state.config)
        saved = {name: checkpoint.read_part(path, state, name) for name in self.parts}
        for name, part in self.parts.items():
            if part is not None and saved[name] is not None:
                restore_part(path, name, part, saved[name])
        self.check_buffer(path, saved.get("rollout_buffer"))
        if unknown := [name for name, value in state.parts.items() if name not in (*schedules, *self.parts) and value]:
            print0(f"checkpoint: {path} holds {', '.join(unknown)}, which this run does not have: not restored")
        self.settle_folder(path)
        self.loaded = path, state
        print0(f"checkpoint: resumed from {path} in {time.perf_counter() - start:.1f} s: rollout "
               f"{state.rollout_id + 1} next, weight_version {state.weight_version}")
        return state.rollout_id + 1, state.weight_version

    def check_buffer(self, path: Path, saved: dict | None) -> None:
        """The groups in flight, restored, must suit this run's rollout settings; without partial rollouts or
        max_staleness they are dropped, with a line."""
        buffer = self.parts.get("rollout_buffer")
        if buffer is not None and saved is not None:
            ro = self.cfg.rollout
            problem = resume_problem(buffer.groups, ro.n_samples_per_prompt, ro.max_new_tokens, ro.max_context_len)
            if problem:
                raise ConfigError(f"checkpoint: {path} holds {len(saved['groups'])} prompt group(s) in flight that "
                                  f"this run cannot continue: {problem}. Resume with the rollout settings it was "
                                  f"saved with, or with rollout.partial_rollout=false and rollout.max_staleness=0 "
                                  f"to drop the groups in flight")
        elif saved is not None and saved["groups"]:  # their prompts were drawn: they come again next epoch
            print0(f"checkpoint: warning: {len(saved['groups'])} prompt group(s) in flight in {path.name} are "
                   f"dropped: this run has rollout.partial_rollout off and rollout.max_staleness=0")

    def settle_folder(self, resumed_from: Path) -> None:
        """What a resume writes in the run folder, once nothing can refuse it any more (rank 0, a collective)."""
        error = ""
        if self.dist.is_main:
            out = Path(self.cfg.log.output_dir)
            try:
                if self.cfg.checkpoint.resume not in ("auto", "never") and not self.restarted:
                    set_aside_newer(out, resumed_from)
                keep_config(out, self.cfg, resumed=True)
            except OSError as e:
                error = f"log.output_dir {str(out)!r}: {type(e).__name__}: {e}"
        if error := parallel.all_gather_objects([error])[0]:
            raise ConfigError(error)

    def restore_rng(self) -> None:
        """Every rank's RNG states as saved; call it once nothing more of the start-up draws from them (after the
        engine build, which seeds the global generators)."""
        if self.loaded:
            checkpoint.restore_rng(*self.loaded)

    def maybe_save(self, rollout_id: int, weight_version: int, force: bool) -> None:
        """Saves on `checkpoint.interval`, or whenever `force` (the last rollout, a stop request); never with -1."""
        interval = self.cfg.checkpoint.interval
        if interval >= 0 and (force or (interval and (rollout_id + 1) % interval == 0)):
            self.save(rollout_id, weight_version)

    def save(self, rollout_id: int, weight_version: int) -> None:
        start = time.perf_counter()
        parts = {name: part.state_dict() if part is not None else None for name, part in self.parts.items()}
        state = checkpoint.TrainerState(rollout_id, weight_version, self.cfg.to_dict(), self.dist.world_size,
                                        parts={**self.learner.state_dict(), **parts})
        path = checkpoint.save(self.cfg.log.output_dir, state, self.models(), self.hf_sources,
                               self.cfg.checkpoint.keep_last)
        print0(f"checkpoint: saved {path} in {time.perf_counter() - start:.1f} s")

    def resume_hint(self) -> str:
        """What the same command does after a stop, said at the end of the stop's line."""
        if self.cfg.checkpoint.interval >= 0:
            return "; run the same command to resume"
        return ": nothing saved (checkpoint.interval=-1); the same command starts over"

    def export(self, learner: Learner, trained: bool) -> None:
        """The finished run's policy as a Hugging Face folder in `<output_dir>/final` (with lora.export_adapter,
        the adapter alone as PEFT loads it in `final_adapter`); `trained`: this process trained, so a folder
        there is older (a run already finished and exported is not exported again)."""
        cfg, out = self.cfg, Path(self.cfg.log.output_dir)
        if not trained and (out / "final").is_dir():
            return
        start = time.perf_counter()
        learner.onload()  # the gathers run on the device
        written = export_policy(learner.policy, self.hf_sources, out / "final", cfg.checkpoint.export_dtype,
                                self.dist.is_main)
        print0(f"rl: the trained policy is in {written} (exported in {time.perf_counter() - start:.1f} s)")
        if cfg.lora.rank and cfg.lora.export_adapter:
            config = json.loads((self.hf_sources[0] / "config.json").read_text())
            written = export_adapter(learner.policy, cfg.lora, cfg.model.path, out / "final_adapter",
                                     cfg.checkpoint.export_dtype, config, self.dist.is_main)
            print0(f"rl: the LoRA adapter alone, as PEFT loads it, is in {written}")

    def close(self) -> None:
        checkpoint.wait_for_removals()
        if self.lock is not None:
            self.lock.close()


def restore_part(path: Path, name: str, part: checkpoint.Stateful, saved: dict) -> None:
    """`part` as checkpoint `path` saved it; a state of another shape (a hand-edited or foreign trainer state) stops
    the resume with one line naming the file and the part, not a traceback."""
    try:
        part.load_state_dict(saved)
    except ConfigError:  # the state is fine, the run does not fit it (another data.seed): said by the part
        raise
    except (KeyError, TypeError, ValueError) as e:
        file = checkpoint.FILE_PARTS.get(name, "trainer_state.json")
        raise ConfigError(f"checkpoint {path}: {file} holds a {name} state this run cannot restore ({error_line(e)}): "
                          f"resume from an earlier checkpoint (--checkpoint.resume=<its folder>) or start afresh in "
                          f"another log.output_dir") from None


def claim_output_dir(cfg: Config, dist: parallel.Dist, restarted: bool):
    """Rank 0 locks the run folder and decides what to resume from; every rank gets the same answer
    (or the same error). A fresh run writes config.json now; a resumed one once its checkpoint has loaded.
    `restarted`: torchrun restarted this job, so rows without a checkpoint are this job's own, written
    before its first save; they move aside and the run starts over."""
    lock, candidates, error = None, [], ""
    if dist.is_main:
        try:
            lock = lock_output_dir(cfg.log.output_dir)
            resume = cfg.checkpoint.resume
            if restarted and checkpoint.complete_checkpoints(cfg.log.output_dir):
                resume = "auto"  # the newest checkpoint is this job's own, whatever the first attempt started from
            elif restarted:
                moved, _, moved_to = keep_rows_before(Path(cfg.log.output_dir) / "metrics.jsonl", 0)
                if moved:
                    print0(f"metrics: {moved} row(s) of the attempt before this restart, which saved no checkpoint, "
                           f"moved to {moved_to}; starting over")
            check_writable(Path(cfg.log.output_dir))
            candidates = resume_candidates(cfg.log.output_dir, resume, cfg.model.path)
            if not candidates:  # a resumed run writes its config once its checkpoint has loaded
                keep_config(Path(cfg.log.output_dir), cfg, resumed=False)
        except ConfigError as e:
            error = str(e)
        except Exception as e:  # e.g. a filesystem without flock: every rank must hear of it, not wait
            error = f"log.output_dir {cfg.log.output_dir!r}: {type(e).__name__}: {e}"
    error, candidates = parallel.all_gather_objects([(error, [str(p) for p in candidates])])[0]
    if error:
        raise ConfigError(error)
    return lock, [Path(p) for p in candidates]


def check_writable(out_dir: Path) -> None:
    """A folder the run cannot write in (read-only, immutable) stops the start with one line, not the first
    save with a traceback after a rollout's work."""
    for folder in (out_dir, checkpoint.checkpoint_root(out_dir)):
        if not folder.is_dir():
            continue
        probe = folder / f".write_check.{os.getpid()}"
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            os.unlink(probe)
        except OSError as e:
            raise ConfigError(f"log.output_dir {str(out_dir)!r}: cannot write in {folder} ({e.strerror or e}): "
                              f"the run keeps its checkpoints there; make it writable or pass another "
                              f"log.output_dir") from None


def keep_config(out_dir: Path, cfg: Config, resumed: bool) -> None:
    path = out_dir / "config.json"
    text = dump(cfg)
    if resumed and path.is_file() and path.read_text() != text:
        earlier = json.loads(path.read_text())
        changed = sorted(f"{section}.{key}" for section, values in cfg.to_dict().items()
                         for key, value in values.items() if earlier.get(section, {}).get(key) != value)
        kept = out_dir / f"config.{time.strftime('%Y%m%d-%H%M%S')}.json"
        os.replace(path, kept)
        print0(f"config: resuming with changed keys {', '.join(changed)}; the earlier config is kept as {kept}")
    path.write_text(text)


# ---------------------------------------------------------------------------- the run folder


def resume_candidates(output_dir: str | Path, resume: str, model_path: str) -> list[Path]:
    """The checkpoints to resume from, newest last ([] for a fresh run), per `checkpoint.resume`; reads only.

    A folder that already holds a run is never written over silently: without a checkpoint to
    continue from, or with `resume = "never"`, the run stops and says what to pass. A resume from an
    older checkpoint of the same run branches it (`set_aside_newer`, once that checkpoint has loaded)."""
    out = Path(output_dir)
    complete = checkpoint.complete_checkpoints(out)
    rows = len(read_metric_rows(out / "metrics.jsonl")[0])
    if resume == "never":
        if complete or rows:
            raise ConfigError(f"log.output_dir {str(out)!r} already holds a run ({rows} metric rows, "
                              f"{len(complete)} checkpoints) and checkpoint.resume='never': pass "
                              f"--checkpoint.resume=auto to continue it, or another log.output_dir")
        return []
    if resume == "auto":
        if not complete:
            if rows:
                raise ConfigError(f"log.output_dir {str(out)!r} holds {rows} metric rows of an earlier run but no "
                                  f"complete checkpoint to resume from: pass another log.output_dir (or remove "
                                  f"that folder to start over there)")
            return []
        newest = newest_readable_state(complete)
        if newest is not None:
            path, state = newest
            written_for = state.config["model"]["path"]
            if os.path.realpath(written_for) != os.path.realpath(model_path):  # `/x/model/` is `/x/model`
                raise ConfigError(f"log.output_dir {str(out)!r} holds checkpoints of a run of model.path "
                                  f"{written_for!r}, not {model_path!r}: pass another log.output_dir, or "
                                  f"--checkpoint.resume={path} to start from it on purpose")
        return complete
    path = Path(resume)
    if not (path / "trainer_state.json").is_file() or not (path / "model_optim").is_dir():
        raise ConfigError(f"checkpoint.resume={resume!r}: not a complete checkpoint folder (expected "
                          f"trainer_state.json and model_optim/; they are under <output_dir>/checkpoints/rollout_<N>)")
    if path.resolve().parent != checkpoint.checkpoint_root(out).resolve() and (complete or rows):
        raise ConfigError(f"checkpoint.resume={resume!r} starts a run from another run's checkpoint, but "
                          f"log.output_dir {str(out)!r} already holds a run ({rows} metric rows, {len(complete)} "
                          f"checkpoints): pass a new log.output_dir")
    return [path]


def newest_readable_state(checkpoints: list[Path]) -> tuple[Path, checkpoint.TrainerState] | None:
    """The newest of `checkpoints` whose trainer state reads, with that state; the unreadable ones are left to
    load_newest, which skips them with a line each."""
    for path in reversed(checkpoints):
        try:
            return path, checkpoint.read_trainer_state(path)
        except checkpoint.DamagedCheckpoint:
            continue
    return None


def set_aside_newer(output_dir: Path, resumed_from: Path) -> None:
    """A resume from an older checkpoint of the same run branches it: the newer checkpoints move to
    `checkpoints/abandoned_<time>/`, kept, but out of reach of `resume=auto` and of pruning."""
    if resumed_from.resolve().parent != checkpoint.checkpoint_root(output_dir).resolve():
        return
    rollout_id = checkpoint.rollout_of(resumed_from)
    newer = [p for p in checkpoint.complete_checkpoints(output_dir) if checkpoint.rollout_of(p) > rollout_id]
    if not newer:
        return
    aside = checkpoint.checkpoint_root(output_dir) / f"abandoned_{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir()
    for path in newer:
        os.replace(path, aside / path.name)
    print(f"checkpoint: resuming from rollout_{rollout_id}: the newer checkpoints "
          f"{', '.join(p.name for p in newer)} are moved to {aside}", flush=True)


def lock_output_dir(output_dir: str | Path):
    """An exclusive lock on the run folder for as long as the returned file stays open (rank 0 holds it)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    handle = (out / ".lock").open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(f"log.output_dir {str(out)!r} is in use by a running job ({holder}): "
                          f"wait for it to end or pass another log.output_dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    return handle
