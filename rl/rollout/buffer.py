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

In a checkpoint the groups in flight are plain JSON (`sample_to_dict`, `to_json`): tuples, bytes, integer
tensors (a sample's routing, base64) and dicts with keys other than strings under a tag, so that a resumed run
continues the very same samples and the file can hold nothing that runs code. A data row's value JSON cannot
hold faithfully stops the run when its group is admitted (`check_plain`), not at the first save.
"""

from __future__ import annotations

import base64
import dataclasses
import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

from rl.config import ConfigError
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
        check_plain(groups)
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


def check_plain(groups: list[list[Sample]]) -> None:
    """Groups in flight go into each checkpoint as JSON (never a pickle): a data row's value JSON cannot hold
    faithfully stops the run at its first rollout with one line, not at its first save."""
    for group in groups:
        for name in ("label", "metadata", "raw_prompt", "columns"):
            try:
                to_json(getattr(group[0], name))
            except TypeError as e:
                raise ConfigError(f"prompt group {group[0].group_index}: its {name} holds {e}, and the groups in "
                                  f"flight (rollout.partial_rollout, rollout.max_staleness) are saved with each "
                                  f"checkpoint as JSON: give the data rows text, numbers, lists and dicts") from None


def sample_to_dict(sample: Sample) -> dict[str, Any]:
    """A plain-JSON copy of `sample` (in the checkpoint's rollout_buffer.json); sample_from_dict gives it back."""
    return {f.name: sample.status.value if f.name == "status" else to_json(getattr(sample, f.name))
            for f in dataclasses.fields(Sample)}


def sample_from_dict(d: dict[str, Any]) -> Sample:
    """The sample that sample_to_dict wrote; ValueError when `d` is not one (a damaged or foreign file)."""
    names = {f.name for f in dataclasses.fields(Sample)}
    if isinstance(d, dict):  # saved before samples kept each reward function's score, or their routing
        d = {"scores": {}, "routed_experts": None} | d
    if not isinstance(d, dict) or d.keys() != names:
        raise ValueError(f"a sample with the keys {sorted(d)[:20] if isinstance(d, dict) else type(d).__name__}, "
                         f"expected {sorted(names)}")
    sample = Sample(**{k: from_json(v) for k, v in d.items()} | {"status": Status(d["status"])})
    wrong = [k for k, kinds in _KINDS.items() if not _is(getattr(sample, k), kinds)]
    routed = sample.routed_experts
    if routed is not None and (type(routed).__name__ != "Tensor" or routed.dim() != 3
                               or routed.shape[1] != len(sample.tokens)):
        wrong.append("routed_experts")
    if wrong:
        raise ValueError(f"sample {sample.index}: {', '.join(wrong)} of the wrong type")
    return sample


# The fields a resumed engine and learner compute with: a foreign file must hold these types.
_KINDS = {"prompt": str, "tokens": (list, int), "response": str, "response_length": int, "loss_mask": (list, int),
          "rollout_log_probs": (list, float), "group_index": int, "index": int, "weight_version": int,
          "token_versions": (list, int), "turns": int, "tool_calls": int}


def _is(value: Any, kind: type | tuple[type, type]) -> bool:
    if isinstance(kind, tuple):
        return type(value) is list and all(type(v) is kind[1] for v in value)
    return type(value) is kind


# ---------------------------------------------------------------------------- a pickle-free form of Python values


_TAGS = frozenset({"__tuple__", "__bytes__", "__items__", "__tensor__"})


def to_json(value: Any) -> Any:
    """`value` as plain JSON that from_json turns back into an equal value of the same types: JSON's own types as
    they are, tuples, bytes, integer tensors and dicts with keys other than strings under a tag. TypeError for any
    other type, whose faithful form JSON has not (a checkpoint never pickles)."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [to_json(v) for v in value]
    if kind is tuple:
        return {"__tuple__": [to_json(v) for v in value]}
    if kind is bytes:
        return {"__bytes__": value.hex()}
    if kind.__module__ == "torch" and kind.__name__ == "Tensor" and not value.is_floating_point():
        return {"__tensor__": [str(value.dtype).removeprefix("torch."), list(value.shape),
                               base64.b64encode(value.cpu().contiguous().numpy().tobytes()).decode()]}
    if kind is dict:
        if all(type(k) is str for k in value) and not _TAGS & value.keys():
            return {k: to_json(v) for k, v in value.items()}
        return {"__items__": [[to_json(k), to_json(v)] for k, v in value.items()]}
    raise TypeError(f"a value of type {kind.__module__}.{kind.__qualname__}")


def from_json(value: Any) -> Any:
    if type(value) is list:
        return [from_json(v) for v in value]
    if type(value) is not dict:
        return value
    if len(value) == 1 and value.keys() <= _TAGS:
        (tag, inner), = value.items()
        if tag == "__tuple__":
            return tuple(from_json(v) for v in inner)
        if tag == "__bytes__":
            return bytes.fromhex(inner)
        if tag == "__tensor__":
            return _tensor(*inner)
        return {from_json(k): from_json(v) for k, v in inner}
    return {k: from_json(v) for k, v in value.items()}


def _tensor(dtype: str, shape: list[int], data: str):
    """An integer tensor of to_json's "__tensor__" form (a sample's routing), its bytes checked against its shape."""
    import torch  # only a sample of a mixture of experts holds one

    raw = bytearray(base64.b64decode(data))
    kind = getattr(torch, dtype, None)
    if not isinstance(kind, torch.dtype) or kind.is_floating_point or len(raw) != math.prod(shape) * kind.itemsize:
        raise ValueError(f"a tensor of {dtype} {shape} held in {len(raw)} bytes")
    return torch.frombuffer(raw, dtype=kind).reshape(shape) if raw else torch.zeros(shape, dtype=kind)
