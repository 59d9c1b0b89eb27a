"""Stop text (rl/rollout/stop_text.py): strings that end a sequence wherever its tokens spell them, in the
automaton, the native engine (rows end at the exact token) and the turn loop (an engine's turn cut after it)."""

import random

import pytest
import torch

from rl.config import EnvConfig, RewardConfig, RolloutConfig
from rl.data import Sample
from rl.env.reward import RewardPool
from rl.rollout import Completion, SamplingParams
from rl.rollout.collect import Collector
from rl.rollout.native import NativeEngine
from rl.rollout.stop_text import STOPPED, StopText
from tests.stand_in import StandInEngine
from tests.test_engine import full_weights
from tests.test_env import ONE_RANK, TOKENIZER
from tests.tiny import tiny_model


def first_stop(texts: list[str], strings: list[str]) -> int | None:
    """The reference: tokens up to the first whose text, appended to those before, holds a string."""
    spelled = ""
    for n, text in enumerate(texts):
        spelled += text
        if any(s in spelled for s in strings):
            return n + 1
    return None


def test_automaton_stops_where_the_text_first_holds_a_string():
    rng = random.Random(0)
    for _ in range(400):
        strings = sorted({"".join(rng.choice("ab`\n") for _ in range(rng.randint(1, 4))) for _ in range(3)})
        vocab = ["".join(rng.choice("ab`\nxy") for _ in range(rng.randint(0, 3))) for _ in range(20)]
        stop = StopText.build(strings, vocab)
        table = stop.table(22)  # ids 20, 21: past the tokenizer (a padded vocabulary): they reset the match
        for _ in range(10):
            tokens = [rng.randrange(22) for _ in range(12)]
            want = first_stop([vocab[t] if t < 20 else "z" for t in tokens], strings)
            assert stop.cut(tokens) == want, (strings, [vocab[t] for t in tokens if t < 20])
            state, walked = 0, None
            for n, t in enumerate(tokens):
                state = int(table[state, t])
                if state == STOPPED:
                    walked = n + 1
                    break
            assert walked == want


def test_a_closing_fence_in_any_split_but_not_an_opening_one():
    """Qwen2.5's tokens for a code block: "```" opens it (and "```" alone may close it), "``" + "`\\n" or
    "```" + "\\n" close it; "```\\n" ends the turn only at the close."""
    vocab = ["```", "python", "\n", "print", "(1)", ")\n", "``", "`\n", "`\n\n", " ```\n"]
    stop = StopText.build(["```\n"], vocab)
    assert stop.cut([0, 1, 2, 3, 4, 5, 6, 7, 3]) == 8  # ``` python \n print (1) )\n `` `\n | print
    assert stop.cut([0, 1, 2, 3, 5, 0, 2, 3]) == 7  # ... )\n ``` \n | print
    assert stop.cut([0, 1, 2, 3, 5, 6, 8]) == 7  # "`\n\n" ends it too
    assert stop.cut([0, 1, 2, 3, 5, 9]) == 6
    assert stop.cut([0, 1, 2, 3, 5, 0]) is None  # closed, the turn's end not written yet


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, vocab_size=len(TOKENIZER)).eval()


PROMPTS = [[40, 41, 42 + i] for i in range(6)]


def test_native_engine_ends_rows_at_the_token_that_completes_the_text(model):
    """Greedy rows stopped by text are the free-running rows cut where the text first appears in their
    tokens (decoded one by one), with the same logprobs, finished "stop"; others run to max_new_tokens."""
    engine = NativeEngine(model.config, torch.device("cpu"), torch.float32, max_batch_size=4, page_size=4,
                          steps_per_poll=3)
    engine.load_weights(full_weights(model))
    params = SamplingParams(max_new_tokens=20, temperature=1.0, top_k=1)
    free = engine.generate(PROMPTS, params)
    texts = [[TOKENIZER.decode([t], skip_special_tokens=True) for t in out.token_ids] for out in free]
    # A string made of the end of one token and the start of the next, from the middle of one row, and one made
    # of three whole tokens of another (where this random model wrote ASCII).
    ascii_at = [[i for i in range(3, 17) if all(t and t.isascii() for t in row[i : i + 3])] for row in texts]
    (r1, i1), (r2, i2) = [(r, at[0]) for r, at in enumerate(ascii_at) if at][:2]
    strings = [texts[r1][i1][-1] + texts[r1][i1 + 1][:1], "".join(texts[r2][i2 : i2 + 3])]
    stop = StopText.from_tokenizer(strings, TOKENIZER)
    stopped = engine.generate(PROMPTS, SamplingParams(max_new_tokens=20, temperature=1.0, top_k=1, stop_text=stop))
    cuts = [first_stop(t, strings) for t in texts]
    assert cuts[r1] <= i1 + 2 and cuts[r2] <= i2 + 3
    for out, whole, cut in zip(stopped, free, cuts):
        assert out.token_ids == whole.token_ids[:cut]
        assert out.logprobs == pytest.approx(whole.logprobs[:cut], abs=1e-5)
        assert out.finish_reason == ("length" if cut is None else "stop")
    assert sum(c is not None and c < 20 for c in cuts) >= 2
    # A row's first token comes from its prompt's prefill, not a decode step: a string it completes ends it there.
    first = next(row[0] for row in texts if row[0] and row[0].isascii())
    stop = StopText.from_tokenizer([first], TOKENIZER)
    stopped = engine.generate(PROMPTS, SamplingParams(max_new_tokens=20, temperature=1.0, top_k=1, stop_text=stop))
    cuts = [first_stop(t, [first]) for t in texts]
    assert 1 in cuts and [out.token_ids for out in stopped] == [w.token_ids[:c] for w, c in zip(free, cuts)]


class TooLong(StandInEngine):
    """An engine blind to stop text (as vLLM, which runs without a tokenizer): every turn runs past it."""

    def __init__(self, turn: list[int]):
        super().__init__()
        self.turn, self.handed = turn, []

    def _generate(self, prompts, params, on_finish, prior, keep):
        self.handed.append(list(prompts))
        return [Completion(list(self.turn), [-0.5] * len(self.turn), "stop") for _ in prompts]


def test_turn_loop_cuts_a_turn_after_its_stop_text():
    """A turn that ran past env.stop's text is the model's tokens up to and with the one that completes it:
    the environment reads that, the sample trains on that, and the next turn continues from there."""
    turn = TOKENIZER.encode("1 + 2 = 3. The answer is 3 and more")
    texts = [TOKENIZER.decode([t]) for t in turn]
    cut = first_stop(texts, ["is 3"])
    assert cut is not None and cut < len(turn)
    engine = TooLong(turn)
    env = EnvConfig(fn="tests.env_fns:counting", max_turns=2, stop=["is 3"])
    sample = Sample(prompt="q", tokens=[40, 41, 42], label="x", raw_prompt="q", group_index=0)
    with RewardPool(RewardConfig(num_workers=1), env.fn) as pool:
        collector = Collector(engine, pool, TOKENIZER, RolloutConfig(max_new_tokens=64), ONE_RANK, env=env)
        scored = collector.generate_and_score([[sample]], SamplingParams(max_new_tokens=64, seed=0), 1, (0,), 60.0)
    (s,) = scored.samples
    appended = TOKENIZER.encode(" result 1")
    assert s.tokens == [40, 41, 42] + turn[:cut] + appended + turn[:cut]
    assert s.loss_mask == [1] * cut + [0] * len(appended) + [1] * cut
    assert engine.handed[1] == [[40, 41, 42] + turn[:cut] + appended]
