import random

import pytest
import torch

from rl.data import Sample
from rl.rollout import SamplingParams, decode_responses
from rl.rollout.native import MAX_STOP_IDS, NativeEngine, sample_tokens
from tests.tiny import tiny_model, tiny_tokenizer


def full_weights(model):
    """What a weight push streams: the state_dict's names (tied ones under each), no computed buffer."""
    return model.state_dict().items()


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1).eval()


@pytest.fixture
def engine(model):
    eng = NativeEngine(model.config, torch.device("cpu"), torch.float32, max_batch_size=8, seed=0)
    eng.load_weights(full_weights(model))
    return eng


PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 3, 3, 3, 3, 3, 8], [2]]
GREEDY = dict(temperature=1.0, top_k=1)


def reference_logprobs(model, prompt, response, temperature=1.0):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return lp[len(prompt) - 1:].tolist()


def assert_kept_turn_as_transformers(model, engine, prompts, first: SamplingParams) -> list:
    """A second turn of each prompt (its first turn's response and three new tokens) over the first turn's kept KV
    prefills only the new tokens and scores as transformers' forward of the whole; returns the first turn."""
    keys = list(range(len(prompts)))
    first_outs = engine.generate(prompts, first, keep=keys)
    turn_2 = [p + o.token_ids + [4, 4, 4] for p, o in zip(prompts, first_outs)]
    second = engine.generate(turn_2, SamplingParams(max_new_tokens=8, temperature=0.7), keep=keys)
    engine.release(keys)
    for prompt, out in zip(turn_2, second, strict=True):
        assert out.reused_tokens == len(prompt) - 4
        assert out.logprobs == pytest.approx(reference_logprobs(model, prompt, out.token_ids, 0.7), abs=1e-4)
    return first_outs


def assert_greedy_as_transformers(model, engine, prompts, max_new_tokens: int) -> None:
    """The engine's greedy responses (top_k 1) are transformers' generate of the same prompts, token for token."""
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, top_k=1))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            hf = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=0)
        assert out.token_ids == hf[0, len(prompt):].tolist()


def test_sampler_top_k_top_p_and_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 64)
    g = torch.Generator().manual_seed(0)
    tok, lp = sample_tokens(logits, 1.0, 1.0, 1, g)
    assert tok.unique().tolist() == [1]
    assert lp[0].item() == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())
    tok, _ = sample_tokens(logits, 1.0, 1.0, 2, g)
    assert set(tok.tolist()) <= {1, 3}
    tok, _ = sample_tokens(logits, 1.0, 0.5, -1, g)  # p(token 1) = 0.64 > 0.5: only it survives
    assert tok.unique().tolist() == [1]
    tok, lp = sample_tokens(logits, 0.5, 1.0, -1, g)
    assert torch.allclose(lp, torch.log_softmax(logits * 2, -1).gather(-1, tok[:, None]).squeeze(-1))


def test_logprobs_match_reference_forward(engine, model):
    params = SamplingParams(max_new_tokens=12, temperature=0.8)
    for prompt, out in zip(PROMPTS, engine.generate(PROMPTS, params)):
        assert out.logprobs == pytest.approx(reference_logprobs(model, prompt, out.token_ids, 0.8), abs=1e-4)


def test_batched_equals_one_at_a_time(engine):
    params = SamplingParams(max_new_tokens=10, **GREEDY)
    batched = [o.token_ids for o in engine.generate(PROMPTS, params)]
    single = [engine.generate([p], params)[0].token_ids for p in PROMPTS]
    assert batched == single


def test_stop_conditions(engine):
    free = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, **GREEDY))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in free)
    stop_id = free[0].token_ids[2]  # greedy decoding reaches this token at step 3
    out = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=6, stop_token_ids=(stop_id,), **GREEDY))[0]
    first = free[0].token_ids.index(stop_id)
    assert out.finish_reason == "stop" and out.token_ids == free[0].token_ids[: first + 1]
    assert len(out.logprobs) == len(out.token_ids)
    # The same stop id last of many (a long-tail benchmark passes hundreds): every one is checked.
    seen = set(free[0].token_ids[: first + 1])
    many = [t for t in range(engine.model.shape.vocab_size) if t not in seen][: MAX_STOP_IDS - 1] + [stop_id]
    assert len(many) > 16
    out = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=6, stop_token_ids=tuple(many), **GREEDY))[0]
    assert out.finish_reason == "stop" and out.token_ids == free[0].token_ids[: first + 1]


def test_sleep_wake_round_trip(engine, model):
    params = SamplingParams(max_new_tokens=8, **GREEDY)
    before = [o.token_ids for o in engine.generate(PROMPTS, params)]
    engine.sleep(1)
    with pytest.raises(RuntimeError, match="sleeping"):
        engine.generate(PROMPTS, params)
    engine.wake_up()
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == before  # level 1 keeps weights
    other = tiny_model(seed=7).eval()  # a push, then level 1 again: the kept host buffers park the new weights
    engine.load_weights(full_weights(other))
    pushed = [o.token_ids for o in engine.generate(PROMPTS, params)]
    assert pushed != before
    engine.sleep(1)
    engine.wake_up()
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == pushed
    engine.sleep(2)
    engine.wake_up(["weights"])
    with pytest.raises(RuntimeError, match="sleeping"):
        engine.generate(PROMPTS, params)  # kv_cache still asleep
    engine.wake_up(["kv_cache"])
    with pytest.raises(RuntimeError, match="before weights were loaded"):
        engine.generate(PROMPTS, params)  # level 2 dropped the weights
    engine.load_weights(list(full_weights(model))[:3])
    with pytest.raises(RuntimeError, match="weights incomplete"):
        engine.generate(PROMPTS, params)  # a load that left tensors out
    engine.load_weights(full_weights(model))
    engine.reset_prefix_cache()
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == before


def test_load_weights_rejects_unknown_names(engine):
    with pytest.raises(KeyError, match="no tensor named"):
        engine.load_weights([("model.nope.weight", torch.zeros(1))])
    name, tensor = next(iter(full_weights(tiny_model())))
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([(name, torch.zeros(tensor.shape[0] + 1))])


@pytest.mark.parametrize("clean_up", [False, True])
def test_responses_decode_in_one_batch_as_the_tokenizer_decodes_each(clean_up):
    """The batched decode (the fast tokenizer's backend, or batch_decode where transformers cleans the text up)
    gives each response exactly what tokenizer.decode gives it: special tokens left out, the prompt not included."""
    tok = tiny_tokenizer()
    tok.clean_up_tokenization_spaces = clean_up
    rng = random.Random(0)
    prompt = tok.encode("What is 2 + 3?")
    samples = []
    for n in (0, 1, 7, 40, 200):
        response = [rng.randrange(len(tok)) for _ in range(n)] + [tok.eos_token_id] * (n % 2)
        samples.append(Sample(prompt="", tokens=prompt + response, response_length=len(response)))
    assert any(t in tok.all_special_ids for s in samples for t in s.tokens[s.prompt_length:])
    want = [tok.decode(s.tokens[s.prompt_length:], skip_special_tokens=True) for s in samples]
    assert decode_responses(tok, samples) == want
