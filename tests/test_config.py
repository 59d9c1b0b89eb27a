import dataclasses
import json
import os
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import pytest

from rl.config import Config, ConfigError, check_paths, config_from_dict, load_config, parse_overrides, resolve

ROOT = Path(__file__).resolve().parents[1]

BASE = {"model": {"path": "m"}, "data": {"source": "d.jsonl"}}


def make(**sections):
    raw = {k: dict(v) for k, v in BASE.items()}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw)


def test_seed_derived_values():
    cfg = make(rollout={"rollout_batch_size": 32, "n_samples_per_prompt": 8}, train={"num_steps_per_rollout": 1},
               algo={"eps_clip": 0.2})
    assert cfg.train.global_batch_size == 32 * 8 // 1 == 256
    assert cfg.algo.eps_clip_high == 0.2
    assert cfg.rollout.over_sampling_batch_size == 32


def test_derived_values_follow_inputs():
    cfg = make(rollout={"rollout_batch_size": 32, "n_samples_per_prompt": 8}, train={"num_steps_per_rollout": 4},
               algo={"eps_clip": 0.2, "eps_clip_high": 0.28})
    assert cfg.train.global_batch_size == 64
    assert cfg.algo.eps_clip_high == 0.28


def test_unknown_key_names_the_key():
    with pytest.raises(ConfigError, match=r"unknown key 'rollout.temprature'"):
        make(rollout={"temprature": 1.0})
    with pytest.raises(ConfigError, match=r"unknown section 'rollouts'"):
        config_from_dict({**BASE, "rollouts": {}})


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"rollout.n_samples_per_prompt: expected int"):
        make(rollout={"n_samples_per_prompt": "8"})
    with pytest.raises(ConfigError, match=r"log.wandb: expected bool"):
        make(log={"wandb": 1})
    assert make(train={"lr": 1}).train.lr == 1.0  # ints are fine where floats are expected


def test_impossible_combinations():
    with pytest.raises(ConfigError, match="num_steps_per_rollout"):
        make(rollout={"rollout_batch_size": 3, "n_samples_per_prompt": 3}, train={"num_steps_per_rollout": 2})
    with pytest.raises(ConfigError, match="data-parallel size"):
        resolve(make(rollout={"rollout_batch_size": 8, "n_samples_per_prompt": 3}, train={"num_steps_per_rollout": 2}), world_size=8)
    with pytest.raises(ConfigError, match="rollout.over_sampling_batch_size .* number of engines"):
        resolve(make(rollout={"rollout_batch_size": 3, "n_samples_per_prompt": 4}), world_size=2)
    with pytest.raises(ConfigError, match="rollout.temperature"):
        make(rollout={"temperature": 0.0})
    with pytest.raises(ConfigError, match="env.stop must list non-empty ASCII text"):
        make(env={"stop": ["答案"]})
    with pytest.raises(ConfigError, match="rollout.partial_rollout needs rollout.max_staleness >= 1"):
        make(rollout={"partial_rollout": True})
    with pytest.raises(ConfigError, match="rollout.max_staleness must be >= 0"):
        make(rollout={"max_staleness": -1})
    with pytest.raises(ConfigError, match=r"over_sampling_batch_size \(65\) .* groups kept in flight: from "
                                          r"rollout_batch_size \(32\) to .* \(64\)"):
        make(rollout={"max_staleness": 1, "over_sampling_batch_size": 65})
    assert make(rollout={"max_staleness": 2, "partial_rollout": True}).rollout.over_sampling_batch_size == 64
    with pytest.raises(ConfigError, match="algo.tis_mode must be one of truncate, mask"):
        make(algo={"tis_mode": "clip"})
    # groups go to the engines one by one through the buffer: any batch size splits
    resolve(make(rollout={"rollout_batch_size": 3, "n_samples_per_prompt": 4, "partial_rollout": True,
                          "max_staleness": 1}, train={"global_batch_size": 12}), world_size=2)
    with pytest.raises(ConfigError,
                       match="algo.advantage_estimator must be one of grpo, grpo_batch_std, dr_grpo, rloo"):
        make(algo={"advantage_estimator": "ppo"})
    with pytest.raises(ConfigError, match="algo.policy_loss must be one of ppo, gspo, cispo; got 'grpo'"):
        make(algo={"policy_loss": "grpo"})
    with pytest.raises(ConfigError, match="algo.kl_estimator"):
        make(algo={"kl_estimator": "k4", "kl_coef": 0.1})
    with pytest.raises(ConfigError, match="algo.eps_clip_c .* must be > 1"):
        make(algo={"eps_clip_c": 0.5})
    with pytest.raises(ConfigError, match="algo.kl_in_reward needs algo.kl_coef > 0"):
        make(algo={"kl_in_reward": True})
    with pytest.raises(ConfigError, match="model.ref_path='r' but algo.kl_coef=0"):
        make(model={"path": "m", "ref_path": "r"})
    with pytest.raises(ConfigError, match="algo.tis_cap with algo.use_rollout_logprobs"):
        make(algo={"tis_cap": 2.0, "use_rollout_logprobs": True})
    with pytest.raises(ConfigError, match="model.compile and model.batch_invariant"):
        make(model={"path": "m", "compile": True, "batch_invariant": True})
    with pytest.raises(ConfigError, match="n_samples_per_prompt=1 with algo.advantage_estimator='rloo'"):
        make(rollout={"n_samples_per_prompt": 1}, algo={"advantage_estimator": "rloo"})
    assert make(rollout={"n_samples_per_prompt": 1}, algo={"advantage_estimator": "reinforce_plus_plus"})
    assert make(rollout={"max_new_tokens": 300}).algo.loss_agg_norm == 300.0
    with pytest.raises(ConfigError, match="rollout.top_k=20 needs rollout.temperature=1"):
        make(rollout={"engine": "vllm", "top_k": 20, "temperature": 0.7})
    with pytest.raises(ConfigError, match="max_context_len"):
        make(rollout={"max_new_tokens": 4000}, data={"max_prompt_len": 512})
    with pytest.raises(ConfigError, match="model.path is required"):
        config_from_dict({"data": {"source": "x.jsonl"}})


def test_overrides_and_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\npath = "m"\n[data]\nsource = "d.jsonl"\n[rollout]\ntemperature = 0.7\n')
    cfg = load_config(["--config", str(path), "--rollout.temperature=0.9", "--log.wandb=true",
                       "--data.source=other.jsonl", "--rollout.stop_token_ids=[1, 2]"])
    assert cfg.rollout.temperature == 0.9
    assert cfg.log.wandb is True
    assert cfg.data.source == "other.jsonl"
    assert cfg.rollout.stop_token_ids == [1, 2]
    with pytest.raises(ConfigError, match="section.key"):
        parse_overrides(["--temperature=1"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(["--config", str(tmp_path / "missing.toml")])


def test_shipped_configs_load():
    from pathlib import Path

    for path in sorted(Path(__file__).parents[1].glob("configs/*.toml")):
        raw = tomllib.loads(path.read_text())
        extra = [f"--{k}=x" for k in ("model.path", "data.source") if not raw[k.split(".")[0]][k.split(".")[1]]]
        cfg = load_config(["--config", str(path), *extra])  # tiny.toml gets its paths on the command line
        json.dumps(cfg.to_dict())


def test_model_and_tokenizer_folders_are_checked_first(tmp_path):
    model, tok = tmp_path / "model", tmp_path / "tok"
    model.mkdir()
    tok.mkdir()
    with pytest.raises(ConfigError, match=r"model.path '.*nope': no such folder"):
        check_paths(make(model={"path": str(tmp_path / "nope")}))
    with pytest.raises(ConfigError, match=r"model.path '.*model': no config.json"):
        check_paths(make(model={"path": str(model)}))
    (model / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"model.path '.*model': no tokenizer.json .* set model.tokenizer"):
        check_paths(make(model={"path": str(model)}))
    with pytest.raises(ConfigError, match=r"model.tokenizer '.*tok': no tokenizer.json"):
        check_paths(make(model={"path": str(model), "tokenizer": str(tok)}))
    (tok / "tokenizer_config.json").write_text("{}")
    check_paths(make(model={"path": str(model), "tokenizer": str(tok)}))
    with pytest.raises(ConfigError, match=r"model.ref_path '.*nope': no config.json"):
        check_paths(make(model={"path": str(model), "tokenizer": str(tok), "ref_path": str(tmp_path / "nope")},
                         algo={"kl_coef": 0.1}))
    with pytest.raises(ConfigError, match=r"critic.path '.*nope': no config.json"):
        check_paths(make(model={"path": str(model), "tokenizer": str(tok)}, critic={"path": str(tmp_path / "nope")},
                         algo={"advantage_estimator": "gae"}))
    check_paths(make(model={"path": str(model), "tokenizer": str(tok), "ref_path": str(model)}, critic={"path": str(model)},
                     algo={"advantage_estimator": "gae", "kl_coef": 0.1}))


def test_help_lists_every_key_of_every_section_with_its_default_and_comment():
    from rl.config import help_request, help_text

    text = help_text()
    sections = typing.get_type_hints(Config)
    tables = [(f.name, sections[f.name]) for f in dataclasses.fields(Config)]
    for name, cls in tables:
        for key, kind in typing.get_type_hints(cls).items():
            if dataclasses.is_dataclass(kind):  # a table of its own: [rollout.vllm]
                tables.append((f"{name}.{key}", kind))
            else:
                assert f"  {name}.{key} = " in text, f"{name}.{key}"
    assert "  rollout.vllm.kv_cache_memory_bytes = None" in text and "\n[rollout.native]\n" in text
    assert "  rollout.max_new_tokens = 1024  (int)\n      tokens a response may have (verl's rollout.response_length)" in text
    assert "false keeps them gathered" in text  # a comment block above its key
    evals = help_text("eval")
    assert "[seed, seed + num_examples)" in evals and "[model]" not in evals
    with pytest.raises(ConfigError, match=r"--help=nope: unknown section \(known: model, data, "):
        help_text("nope")
    assert [help_request(a) for a in (["--help"], ["--help=eval"], ["--help", "eval"], ["-h", "--config", "x"],
                                      ["--config", "x.toml"])] == ["", "eval", "eval", "", None]


def test_a_variant_key_is_checked_and_explained_from_its_table():
    """Validation and --help list what the variant tables hold (rl/train/algo.py's and rl/config.py's), row for row."""
    from rl.config import choices, help_text

    with pytest.raises(ConfigError, match=r"^rollout.engine must be one of native, vllm; got 'sglang'$"):
        make(rollout={"engine": "sglang"})
    with pytest.raises(ConfigError, match=r"^rollout.dynamic_filter must be one of '', nonzero_std; got 'std'$"):
        make(rollout={"dynamic_filter": "std"})
    with pytest.raises(ConfigError, match=r"^algo.loss_agg must be one of token_mean, seq_mean_token_mean, "
                                          r"seq_mean_token_sum_norm; got 'seq_sum'$"):
        make(algo={"loss_agg": "seq_sum"})
    text = " ".join(help_text().split())
    for key, table in choices().items():
        section, name_of_key = key.split(".")
        for name, line in table.items():
            assert f'"{name}": {" ".join(line.split())}' in text, f"{key} = {name!r}"
            if key != "rollout.engine":  # vllm is checked for being installed
                assert getattr(getattr(make(**{section: {name_of_key: name}}), section), name_of_key) == name


def test_help_on_the_command_line_exits_0():
    proc = subprocess.run([sys.executable, "-m", "rl.main", "--help=train"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert "  train.lr = 1e-06  (float)" in proc.stdout and "[rollout]" not in proc.stdout


def test_engine_keys_live_in_their_tables_and_an_old_key_names_its_new_place():
    cfg = load_config(["--model.path=m", "--data.source=d.jsonl", "--rollout.vllm.kv_cache_memory_bytes=1024",
                       "--rollout.native.steps_per_poll=4", "--rollout.vllm.kwargs={block_size=32}"])
    assert cfg.rollout.vllm.kv_cache_memory_bytes == 1024 and cfg.rollout.native.steps_per_poll == 4
    assert cfg.rollout.vllm.kwargs == {"block_size": 32}
    with pytest.raises(ConfigError, match=r"^'rollout.gpu_memory_utilization' is now "
                                          r"'rollout.vllm.gpu_memory_utilization' \(its engine's table\)$"):
        load_config(["--model.path=m", "--data.source=d.jsonl", "--rollout.gpu_memory_utilization=0.3"])
    with pytest.raises(ConfigError, match=r"^rollout.max_batch_size: expected int, got dict \{'x': 1\}$"):
        load_config(["--model.path=m", "--data.source=d.jsonl", "--rollout.max_batch_size.x=1"])
