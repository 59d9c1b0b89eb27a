"""The RL loop, top to bottom: `torchrun --nproc-per-node N -m rl.main --config FILE [--section.key=value ...]`.

Every rank runs this same program: it generates its share of prompt groups with its own engine, scores them,
gathers the rollout, trains its length-balanced share with FSDP2, and pushes the new weights into its engine.
Each phase has one home: `Collector` (generate -> score -> gather, rl/rollout/collect.py), `Learner` (the policy,
its optimizer, reference and critic: train and push, rl/train/learner.py), `RunCheckpointer` (the run folder,
resume, saves and the final export, rl/run/checkpointer.py); stop requests, restarts and the CLI are rl/launch.py's.
"""

from __future__ import annotations

import sys

from rl.run.finished import exit_if_finished

if __name__ == "__main__":  # a finished run says so before torch and transformers load (seconds of imports)
    exit_if_finished(sys.argv[1:])

import dataclasses
import os
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from rl import launch, parallel
from rl.config import Config, ConfigError, check_paths, dump, load_config, resolve
from rl.data import PromptDataset
from rl.env.reward import RewardPool
from rl.parallel import print0
from rl.rollout import SamplingParams, build_engine
from rl.rollout.buffer import RolloutBuffer
from rl.rollout.collect import Collector, dump_rollout, rollout_metrics
from rl.rollout.evaluate import evaluate, held_out_prompts
from rl.run.checkpointer import RunCheckpointer
from rl.run.checks import check_model_and_tokenizer
from rl.run.health import Health, RunStopped
from rl.run.memory import check_disk_space, check_memory_plan, choose_allocator, stop_on_oom
from rl.run.metrics import make_logger
from rl.train.learner import Learner, TrainResult
from rl.train.measure import StepRecord, profile_path, profiled
from rl.train.weights import sync_weights

STARTUP_TIMEOUT_S = 1800.0  # the process group's own timeout while models load and kernels compile


@dataclasses.dataclass
class Run:
    """Everything the loop works with, built once at start-up."""

    cfg: Config
    dist: parallel.Dist
    stop: launch.StopRequests
    dataset: PromptDataset
    eval_prompts: list
    sampling: SamplingParams
    reward_pool: RewardPool | None
    learner: Learner
    health: Health
    engine: object
    collector: Collector
    checkpointer: RunCheckpointer
    start: int  # the first rollout this process runs
    weight_version: int  # of the weights in the engine
    restart_stats: dict


def main(argv: list[str]) -> None:
    stop = launch.StopRequests(os.environ.get("RL_STOP_FILE"), os.environ.get("RANK", "0"))
    cfg = load_config(argv)  # config errors surface before any process group or model exists
    check_paths(cfg)
    choose_allocator(cfg.rollout.engine)  # before CUDA starts
    dist = parallel.init_distributed()
    cfg = resolve(cfg, dist.world_size)
    if cfg.model.batch_invariant and dist.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("model.batch_invariant runs the native engine's Triton kernels in the trainer too: it needs "
                          "a CUDA device (on a CPU only under TRITON_INTERPRET=1, for tests)")
    run = start_up(cfg, dist, stop)
    finished = run.start >= cfg.train.num_rollout
    # A resumed run replaces the rows written after its checkpoint; a finished one keeps all (its final eval too).
    logger = make_logger(dist.is_main, cfg.log.output_dir, cfg.to_dict(), cfg.log.wandb, cfg.log.wandb_project,
                         cfg.log.run_name, start_rollout=None if finished else run.start)
    try:
        if finished:
            print0(f"rl: the run in {cfg.log.output_dir} already finished rollout {run.start - 1} (train.num_rollout="
                   f"{cfg.train.num_rollout}); pass a larger --train.num_rollout to train further")
        elif stop_requested(stop):  # nothing trained yet: nothing to save
            print0(f"rl: stopped before rollout {run.start} ({stop.reason() or 'a stop request on another rank'}): "
                   f"nothing new to save; run the same command to {'resume' if run.start else 'start'}")
        elif train(run, logger):
            finished = True
            if run.eval_prompts:  # the trained policy, in a row of its own
                logger.log({"rollout_id": cfg.train.num_rollout, "weight_version": run.weight_version,
                            **run_eval(run, cfg.train.num_rollout)})
        if finished:
            run.checkpointer.export(run.learner, trained=run.start < cfg.train.num_rollout)
        print0(run.health.summary())
    finally:
        logger.close()
        if run.reward_pool is not None:
            run.reward_pool.close()
        run.checkpointer.close()
    run.engine.close()  # vLLM's model-parallel groups go before the process group they live in
    parallel.teardown()


def start_up(cfg: Config, dist: parallel.Dist, stop: launch.StopRequests) -> Run:
    """Claims the run folder, reads the data, builds the learner and the engine, resumes, and pushes the
    first weights (version 1 on a fresh run)."""
    restart_stats = {"run/restarts": launch.restart_count()}
    if restart_stats["run/restarts"]:  # torchrun started every rank again after one died
        restart_stats["run/restart_cause"] = launch.restart_cause(launch.previous_attempt_errors())
        print0(f"rl: restart {restart_stats['run/restarts']} of at most "
               f"{os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}, after: {restart_stats['run/restart_cause']}")
    checkpointer = RunCheckpointer(cfg, dist, restarted=restart_stats["run/restarts"] > 0)
    print0(f"rl: world_size={dist.world_size} device={dist.device.type}\n{dump(cfg)}")
    hf_config = AutoConfig.from_pretrained(cfg.model.path)
    check_memory_plan(cfg, hf_config, dist.world_size, dist.device)  # a plan that cannot fit stops before any weights
    check_disk_space(cfg, hf_config)  # and a disk without room for a checkpoint and the export
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.path)
    eos_ids = check_model_and_tokenizer(cfg.model, cfg.rollout, hf_config, tokenizer)
    dataset = checkpointer.parts["data"] = PromptDataset.from_config(cfg.data, tokenizer)
    print0(f"data: {len(dataset.prompts)} prompts, {dataset.num_filtered} dropped by max_prompt_len")
    # Only the first rank of each engine scores: the ranks of a TP group hold the same samples.
    scores = dist.rank % cfg.rollout.tensor_parallel_size == 0  # one reward pool per engine
    reward_pool = RewardPool(cfg.reward, cfg.env.fn, cfg.train) if scores else None
    eval_prompts = held_out_prompts(cfg, tokenizer, dataset) if cfg.eval.source else []
    learner = checkpointer.learner = Learner(cfg, dist)
    health = checkpointer.parts["health"] = Health(
        cfg.train.max_bad_steps, cfg.reward.max_failed_steps, learner.policy.config.vocab_size,
        cfg.rollout.max_staleness, cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt)
    buffer = checkpointer.parts["rollout_buffer"] = (  # else each rollout trains its own groups
        RolloutBuffer(cfg.rollout.rollout_batch_size, cfg.rollout.max_staleness) if cfg.rollout.buffered else None)
    start, weight_version = checkpointer.resume()
    with stop_on_oom("engine start-up", cfg, dist.device):
        engine = build_engine(cfg.rollout, cfg.model.path, learner.policy.config, dist.device, dist.rank,
                              cfg.model.batch_invariant)
    checkpointer.restore_rng()  # after the engine build, which seeds the global generators (vLLM does)
    with stop_on_oom("push", cfg, dist.device):
        sync_weights(learner.policy, engine, learner.engine_dtype, cfg.weights.bucket_mb)
    learner.offload()
    collector = Collector(engine, reward_pool, tokenizer, cfg.rollout, dist, cfg.log.progress, buffer, cfg.env)
    return Run(cfg, dist, stop, dataset, eval_prompts, SamplingParams.from_config(cfg.rollout, eos_ids), reward_pool,
               learner, health, engine, collector, checkpointer, start, weight_version, restart_stats)


def train(run: Run, logger) -> bool:
    """The loop, one rollout a step; returns whether it ran to train.num_rollout (False: stopped on request)."""
    cfg, dist = run.cfg, run.dist
    for rollout_id in range(run.start, cfg.train.num_rollout):
        record = StepRecord(dist.device)
        # A device out-of-memory error in a phase stops the run with one line, before this step's checkpoint.
        with stop_on_oom("rollout", cfg, dist.device):
            # Held-out eval of the weights this rollout generates with (rollout 0: before the first update).
            eval_stats = run_eval(run, rollout_id) if run.eval_prompts and rollout_id % cfg.eval.interval == 0 else {}
            # Rollout: draw prompt groups, generate on every engine, score, gather, apply the dynamic filter.
            with profiled(profile_path(cfg.log, "generate", rollout_id, dist.rank)):
                samples, rollout_stats = run.collector.rollout(run.dataset, run.sampling, run.weight_version,
                                                               rollout_id, barrier_timeout(run, rollout_id))
        check_rewards(run, logger, rollout_id, rollout_stats)
        record.memory_after("rollout")
        # The engine yields the device to training.
        with record.timed("perf/offload_s"):
            run.engine.sleep(cfg.rollout.sleep_level)
        record.memory_after("asleep")
        # Train: advantages, reference and old logprobs where needed, the policy loss, the optimizer steps.
        with stop_on_oom("train", cfg, dist.device):
            result = run.learner.train(samples, record, profile_path(cfg.log, "train", rollout_id, dist.rank))
        # Weights into the engine; the version moves when a step was taken.
        with stop_on_oom("push", cfg, dist.device):
            sync_stats = run.learner.push(run.engine, record)
        run.weight_version += int(result.stats["train/skipped_steps"] < result.num_steps)
        log_row(run, logger, rollout_id, samples, result, record,
                {**rollout_stats, **result.stats, **sync_stats, **eval_stats})
        if rollout_id == run.start:  # start-up (loading, compiling, the first rollout) is over
            parallel.set_collective_timeout(cfg.train.collective_timeout_s, dist.mesh)
        # Checkpoint on the interval, after the last rollout, and when asked to stop.
        stopping, last = stop_requested(run.stop), rollout_id == cfg.train.num_rollout - 1
        run.checkpointer.maybe_save(rollout_id, run.weight_version, force=last or stopping)
        if stopping and not last:  # a stop at the last rollout still ends the run: final eval and export
            print0(f"rl: stopping after rollout {rollout_id} ({run.stop.reason() or 'a stop request on another rank'})"
                   + run.checkpointer.resume_hint())
            return False
    return True


def check_rewards(run: Run, logger, rollout_id: int, rollout_stats: dict) -> None:
    """Counts a step whose every reward failed; a streak of them stops the run, with the step's rollout row kept."""
    try:
        run.health.after_rewards(int(rollout_stats["rollout/num_scored"]),  # 0: nothing scored, no reward metrics
                                 int(rollout_stats.get("reward/num_errors", 0)
                                     + rollout_stats.get("reward/num_timeouts", 0)))
    except RunStopped:
        logger.log({"rollout_id": rollout_id, "weight_version": run.weight_version, **rollout_stats,
                    **run.health.metrics()})
        raise


def log_row(run: Run, logger, rollout_id: int, samples: list, result: TrainResult, record: StepRecord,
            stats: dict) -> None:
    """The step's samples (every log.sample_interval rollouts: a JSONL file, and with wandb a completions table),
    then its row after the health checks on it (also when a check stops the run)."""
    cfg = run.cfg
    if cfg.log.sample_interval and rollout_id % cfg.log.sample_interval == 0:
        if run.dist.is_main:
            dump_rollout(samples, result.mismatch, Path(cfg.log.output_dir) / "samples" / f"rollout_{rollout_id}.jsonl")
        logger.log_completions(rollout_id, samples)
    row = {"rollout_id": rollout_id, "weight_version": run.weight_version, **run.restart_stats,
           **rollout_metrics(samples, cfg.rollout.n_samples_per_prompt), **stats,
           "data/epoch": run.dataset.epoch, "data/prompts_filtered": run.dataset.num_filtered, **record.metrics()}
    run.restart_stats.pop("run/restart_cause", None)  # said once, in the first row after the restart
    try:
        run.health.after_train(row, result.num_steps)
    finally:
        row |= run.health.metrics()
        logger.log(row)


def run_eval(run: Run, rollout_id: int) -> dict[str, float]:
    stats = evaluate(run.collector, run.eval_prompts, run.cfg.eval, run.sampling, run.weight_version,
                     barrier_timeout(run, rollout_id),
                     Path(run.cfg.log.output_dir) / "samples" / f"eval_rollout_{rollout_id}.jsonl")
    shown = {k: v for k, v in stats.items() if k != "eval/reward_errors" or v}  # named only when some failed
    print0(f"eval before rollout {rollout_id} (weight_version {run.weight_version}): "
           + " | ".join(f"{k.removeprefix('eval/')}={v:.4g}" for k, v in shown.items()))
    return stats


def barrier_timeout(run: Run, rollout_id: int) -> float:
    """How long ranks wait for each other after generating: the start-up bound through a process's first
    rollout (loading, compiling), `train.collective_timeout_s` after it."""
    return run.cfg.train.collective_timeout_s if rollout_id > run.start else STARTUP_TIMEOUT_S


def stop_requested(stop: launch.StopRequests) -> bool:
    """Whether any rank was asked to stop (a collective: every rank gets the same answer)."""
    return parallel.all_reduce_max(float(stop.reason() is not None)) > 0


if __name__ == "__main__":
    sys.exit(launch.cli(main, sys.argv[1:]))
