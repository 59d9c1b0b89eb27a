"""The prompt groups in flight between rollouts: partial rollouts and staleness-bounded asynchronous training.

With `rollout.partial_rollout` a rollout ends once enough groups are complete instead of waiting for its
longest sample; the unfinished groups stay here, each sample holding its tokens, the engine's logprob of each
and the weight version that sampled each, and the next rollout continues them under the new weights (the
engine computes their KV anew). With `rollout.max_staleness` > 0 and no partial rollouts, a rollout generates
up to (max_staleness + 1) rollouts' worth of groups at once and later rollouts train on the complete ones
it kept, without generating.

Staleness of a sample: the version of the weights being trained minus the version that sampled its oldest
token (0 in the synchronous loop). No trained sample may exceed `max_staleness`. Three rules keep it so:

- Admission: groups admitted so far <= groups consumed (trained, filtered out, dropped) before this moment +
  rollout.over_sampling_batch_size, at most (max_staleness + 1) * rollout_batch_size: every rollout consumes
  at least rollout_batch_size groups, so were they consumed in admission order, by rollout t at most
  rollout_batch_size groups admitted at rollout t - max_staleness or earlier would be left.
- Due groups: a group whose oldest token would pass the bound at the next rollout is due: the rollout goes
  on generating until every due group is complete, and trains the oldest complete groups first.
- Schedule: groups finish out of order (a young group can finish before an old one and take its place in a
  batch), so admission alone lets more groups fall due in one rollout than its batch holds. A partial
  rollout therefore also goes on until, for every k < max_staleness, at most k * rollout_batch_size unfinished
  groups fall due within the next k rollouts (k = 0 is the due rule); then the oldest-first batches of the
  rollouts to come can take every group before it passes the bound.

A group that still passes the bound (weights pushed more often than counted here) is dropped, never
trained, and counted. Groups stay whole: a group trains once all its samples are finished.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from typing import Any

from rl.data import Sample, Status

FINISHED = (Status.COMPLETED, Status.TRUNCATED)


def is_finished(group: list[Sample]) -> bool:
    return all(s.status in FINISHED for s in group)


def oldest_version(group: list[Sample]) -> int | None:
    """The version that sampled the group's oldest token; None before any token is sampled."""
    return min((v for s in group for v in s.token_versions[:1]), default=None)


def staleness(group: list[Sample], weight_version: int) -> int:
    oldest = oldest_version(group)
    return 0 if oldest is None else weight_version - oldest


def due_in(group: list[Sample], weight_version: int, max_staleness: int) -> int | None:
    """Rollouts left before the group must be trained: 0 in the last rollout its oldest token is within the bound
    (it is due); None before any token is sampled."""
    oldest = oldest_version(group)
    return None if oldest is None else oldest + max_staleness - weight_version


def on_schedule(due_ins: Iterable[int | None], max_staleness: int, per_rollout: int) -> bool:
    """Whether unfinished groups due in `due_ins` rollouts can all still be trained in time by batches of
    `per_rollout` groups taken oldest first: for every k < max_staleness, at most k * per_rollout of them fall due
    within k rollouts (none is due now)."""
    counts = Counter(max(d, 0) for d in due_ins if d is not None)
    falling = 0
    for k in range(max_staleness):
        falling += counts[k]
        if falling > k * per_rollout:
            return False
    return True


class RolloutBuffer:
    def __init__(self, rollout_batch_size: int, max_staleness: int):
        self.rollout_batch_size, self.max_staleness = rollout_batch_size, max_staleness
        self.groups: list[list[Sample]] = []  # admitted, not consumed; in admission order (group_index)
        self.admitted = 0  # groups, over the run
        self.consumed = 0

    def room(self) -> int:
        """Groups that may be admitted now without risking a sample past the staleness bound."""
        return max(self.consumed + (self.max_staleness + 1) * self.rollout_batch_size - self.admitted, 0)

    def admit(self, groups: list[list[Sample]]) -> None:
        self.groups += groups
        self.admitted += len(groups)

    def unfinished(self) -> list[list[Sample]]:
        return [g for g in self.groups if not is_finished(g)]

    def finished(self) -> list[list[Sample]]:
        return [g for g in self.groups if is_finished(g)]

    def update(self, groups: list[list[Sample]]) -> None:
        """Puts back groups as generation left them (every rank's copy after a gather), by group_index."""
        by_index = {g[0].group_index: g for g in groups}
        unknown = by_index.keys() - {g[0].group_index for g in self.groups}
        if unknown:
            raise RuntimeError(f"rollout buffer: groups {sorted(unknown)[:5]} came back but are not in flight")
        self.groups = [by_index.get(g[0].group_index, g) for g in self.groups]

    def consume(self, groups: list[list[Sample]]) -> None:
        """Removes groups that were trained, filtered out or dropped."""
        gone = {g[0].group_index for g in groups}
        self.groups = [g for g in self.groups if g[0].group_index not in gone]
        self.consumed += len(gone)

    def state_dict(self) -> dict[str, Any]:
        return {"admitted": self.admitted, "consumed": self.consumed,
                "groups": [[sample_to_dict(s) for s in g] for g in self.groups]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.admitted, self.consumed = state["admitted"], state["consumed"]
        self.groups = [[sample_from_dict(s) for s in g] for g in state["groups"]]


def resume_problem(groups: list[list[Sample]], n_samples: int, max_new_tokens: int,
                   max_context_len: int) -> str | None:
    """Why saved groups in flight cannot go on under a resumed run's rollout settings (None: they can): groups of
    another size than its n_samples_per_prompt, or an unfinished sample the engine could not continue (already at its
    max_new_tokens, or a prompt too long for max_new_tokens more in its context)."""
    sizes = sorted({len(g) for g in groups} - {n_samples})
    if sizes:
        return f"groups of {sizes} samples in flight, but rollout.n_samples_per_prompt={n_samples}"
    pending = [s for g in groups for s in g if s.status not in FINISHED]
    held = max((s.response_length for s in pending), default=0)
    if held >= max_new_tokens:
        return (f"an unfinished sample holds {held} response tokens, but rollout.max_new_tokens={max_new_tokens} "
                f"leaves it none to generate")
    prompt = max((s.prompt_length for s in pending), default=0)
    if prompt + max_new_tokens > max_context_len:
        return (f"an unfinished sample's prompt of {prompt} tokens + rollout.max_new_tokens={max_new_tokens} exceeds "
                f"rollout.max_context_len={max_context_len}")
    return None


def sample_to_dict(sample: Sample) -> dict[str, Any]:
    """A JSON-safe copy (floats round-trip exactly through JSON), so a resumed run continues the same samples."""
    return {**dataclasses.asdict(sample), "status": sample.status.value}


def sample_from_dict(d: dict[str, Any]) -> Sample:
    return Sample(**{**d, "status": Status(d["status"])})
