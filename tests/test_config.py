import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omni_rl.config import recipe_name, save_config, to_dict
from omni_rl.demos.demo_config import DemoConfig
from omni_rl.engine.config import AdamWConfig, SGDConfig
from omni_rl.errors import ConfigError, OmniRLError
from omni_rl.recipe_loader import config_from_dict, load_config, root_config, runner
from omni_rl.recipe_table import RECIPES, class_path, get_recipe, recipe_names, recipe_of, trainable

ROOT = Path(__file__).parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    recipe = get_recipe(yaml.safe_load(path.read_text())["recipe"])
    assert type(cfg) is root_config(recipe) and recipe_of(cfg) is recipe


def test_shipped_configs_exist():
    assert {p.name for p in CONFIGS} >= {"demo.yaml", "demo_qwen2_5_vl_7b.yaml"}


def test_defaults_build_without_a_file():
    cfg = load_config(None, recipe="demo")
    assert isinstance(cfg, DemoConfig)
    assert isinstance(cfg.optimizer, AdamWConfig)


def test_unknown_key_names_key_section_and_closest_valid_key():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"recipe": "demo", "trainer": {"stpes": 3}}, source="my.yaml")
    message = str(err.value)
    assert message.startswith("my.yaml: trainer.stpes:")
    assert "unknown key 'stpes' in section 'trainer'" in message
    assert "did you mean 'steps'?" in message


def test_unknown_top_level_section():
    with pytest.raises(ConfigError, match=r"unknown key 'trainr' in the top level \(did you mean 'trainer'\?\)"):
        config_from_dict({"recipe": "demo", "trainr": {}})


def test_wrong_type_names_the_field():
    with pytest.raises(ConfigError, match=r"trainer\.steps: expected an integer, got str 'ten'"):
        config_from_dict({"recipe": "demo", "trainer": {"steps": "ten"}})
    with pytest.raises(ConfigError, match=r"trainer\.steps: expected an integer, got bool"):
        config_from_dict({"recipe": "demo", "trainer": {"steps": True}})
    with pytest.raises(ConfigError, match=r"run\.device: must be one of 'auto', 'cpu', 'cuda', got 'tpu'"):
        config_from_dict({"recipe": "demo", "run": {"device": "tpu"}})
    with pytest.raises(ConfigError, match=r"optimizer\.betas: expected 2 items, got 3"):
        config_from_dict({"recipe": "demo", "optimizer": {"betas": [0.9, 0.9, 0.9]}})


def test_out_of_range_value_names_the_field():
    with pytest.raises(ConfigError, match=r"trainer\.steps: must be >= 1"):
        config_from_dict({"recipe": "demo", "trainer": {"steps": 0}})
    expected = r"model\.tiny_family: unknown family 'qwen2_5vl' \(did you mean 'qwen2_5_vl'"
    with pytest.raises(ConfigError, match=expected):
        config_from_dict({"recipe": "demo", "model": {"tiny_family": "qwen2_5vl"}})


@pytest.mark.parametrize(
    ("setting", "error"),
    [
        ("optimizer.betas=[1.5, 0.999]", r"optimizer\.betas: each must be in \[0, 1\)"),
        ("optimizer.eps=-1", r"optimizer\.eps: must be >= 0"),
        ("optimizer={type: sgd, momentum: 1.5}", r"optimizer\.momentum: must be in \[0, 1\)"),
        ("rollout.max_prompt_length=0", r"rollout\.max_prompt_length: must be >= 1"),
        ("algorithm.max_resample_rounds=-1", r"algorithm\.max_resample_rounds: must be >= 0"),
        ("model.lora={rank: 8, alpha: 0}", r"model\.lora\.alpha: must be > 0"),
        ("algorithm.overlong_factor=-2", r"algorithm\.overlong_factor: must be >= 0"),
        (
            "algorithm={overlong: penalty, overlong_buffer: 4096}",
            r"algorithm\.overlong_buffer: 4096 is more than rollout\.max_new_tokens \(256\)",
        ),
    ],
)
def test_values_out_of_range_are_refused_as_the_config_loads(setting, error):
    """These loaded, and failed only once the model was built (betas, eps), skipped
    every prompt (max_prompt_length), made the adapters a no-op (alpha 0), paid an
    overlong answer (a negative factor) or penalized every completion (a buffer past
    max_new_tokens, clamped to it without a word)."""
    with pytest.raises(ConfigError, match=error):
        load_config(None, [setting], recipe="grpo")


@pytest.mark.parametrize(
    "section",
    [
        {"model": {"lora": {"rank": 4}}},
        {"model": {"gradient_checkpointing": True}},
        {"model": {"freeze_vision_tower": True}},
        {"trainer": {"save_every": 5}},
        {"trainer": {"micro_batch_size": 2}},
        {"trainer": {"dist_timeout_minutes": 5}},
    ],
)
def test_the_demo_refuses_the_model_and_trainer_fields_it_never_reads(section):
    """The demo shares the model and trainer sections of the recipes, but trains every
    weight of one clip a step in one process and writes its model once: a LoRA, a
    checkpoint interval and the like would be taken and ignored."""
    ((name, fields),) = section.items()
    (field,) = fields
    with pytest.raises(ConfigError, match=rf"{name}\.{field}: does nothing in the demo"):
        config_from_dict({"recipe": "demo", **section})
    config_from_dict({"recipe": "demo", "trainer": {"steps": 3, "max_grad_norm": 2.0}})  # what it reads


def test_a_set_value_that_is_not_yaml_is_a_config_error_with_the_quoting():
    """``--set data.prompt_template={problem}{options}`` (the field's default text) is
    not YAML: a one-line error saying how to quote it, not PyYAML's traceback."""
    from omni_rl.config import parse_override

    with pytest.raises(
        ConfigError, match=r"the value is not YAML .*--set \"data\.prompt_template='\{problem\}\{options\}'\""
    ):
        parse_override("data.prompt_template={problem}{options}")
    assert parse_override("data.prompt_template='{problem}{options}'") == (
        ["data", "prompt_template"],
        "{problem}{options}",
    )


def test_floats_accept_ints_and_exponent_strings():
    cfg = config_from_dict({"recipe": "demo", "optimizer": {"lr": "1e-6"}, "trainer": {"max_grad_norm": 2}})
    assert cfg.optimizer.lr == pytest.approx(1e-6)
    assert cfg.trainer.max_grad_norm == 2.0 and isinstance(cfg.trainer.max_grad_norm, float)


def test_type_key_picks_the_registered_class():
    cfg = config_from_dict({"recipe": "demo", "optimizer": {"type": "sgd", "momentum": 0.5}})
    assert isinstance(cfg.optimizer, SGDConfig)
    assert cfg.optimizer.momentum == 0.5
    with pytest.raises(ConfigError, match=r"optimizer\.type: unknown optimizer 'adam' \(did you mean 'adamw'\?\)"):
        config_from_dict({"recipe": "demo", "optimizer": {"type": "adam"}})
    # a field of another choice is unknown here
    with pytest.raises(ConfigError, match=r"optimizer\.momentum: unknown key 'momentum'"):
        config_from_dict({"recipe": "demo", "optimizer": {"type": "adamw", "momentum": 0.5}})


def test_unknown_recipe_and_missing_recipe():
    with pytest.raises(ConfigError, match=r"unknown recipe 'dem' \(did you mean 'demo'\?\)"):
        config_from_dict({"recipe": "dem"})
    with pytest.raises(ConfigError, match="missing 'recipe' key"):
        config_from_dict({"trainer": {}})


def test_overrides_are_typed_and_validated(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("recipe: demo\ntrainer:\n  steps: 3\n")
    cfg = load_config(path, ["trainer.steps=7", "optimizer.lr=0.5", "run.threads=2", "model.path=/x/y"])
    assert cfg.trainer.steps == 7
    assert cfg.optimizer.lr == 0.5
    assert cfg.run.threads == 2
    assert cfg.model.path == "/x/y"
    with pytest.raises(ConfigError, match=r"trainer\.stpes: unknown key 'stpes'"):
        load_config(path, ["trainer.stpes=7"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(path, ["trainer.steps"])
    with pytest.raises(ConfigError, match=r"'trainer\.steps' is not a section"):
        load_config(path, ["trainer.steps.x=1"])


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("recipe: demo\ntrainer:\n  steps: [1,\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: invalid YAML \(line \d+\)"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["optimizer.type=sgd", "trainer.steps=4", "video.direction=up"], recipe="demo")
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    data = yaml.safe_load(path.read_text())
    assert data["recipe"] == "demo"
    assert data["optimizer"]["type"] == "sgd"
    assert load_config(path) == cfg
    assert to_dict(load_config(path)) == to_dict(cfg)


# ---------------------------------------------------------------------- the recipe table


def test_one_table_knows_every_recipe_and_its_runner():
    assert recipe_names() == [
        "demo",
        "flow_ppo",
        "grpo",
        "preprocess",
        "quickstart",
        "quickstart_audio",
        "quickstart_sim",
        "quickstart_vla",
        "sft",
    ]
    assert trainable() == ["flow_ppo", "grpo", "sft"]
    assert len(RECIPES) == len(recipe_names())  # one row per name
    for recipe in RECIPES:
        assert get_recipe(recipe.name) is recipe
        root = root_config(recipe)
        # the row names the class where it is defined: save_config finds a name by it
        assert class_path(root) == recipe.config
        assert recipe_name(root()) == recipe.name  # every root config builds from defaults
        assert recipe_of(root) is recipe
        if recipe.runner is not None:
            assert callable(runner(recipe))
    assert get_recipe("grpo").runner == "omni_rl.recipes.grpo:train"
    assert get_recipe("quickstart").runner == "omni_rl.demos.quickstart:main"
    with pytest.raises(OmniRLError, match=r"unknown recipe 'gpro' \(did you mean 'grpo'\?\); known: demo, flow_ppo"):
        get_recipe("gpro")


@pytest.mark.slow
def test_reading_configs_imports_no_training_loop():
    code = (
        "import sys; from omni_rl.recipe_loader import load_config; load_config('configs/grpo_tiny_shapes.yaml');"
        "load_config('configs/quickstart.yaml');"
        "prefixes = ('omni_rl.recipes.', 'omni_rl.demos.', 'omni_rl.engine.');"
        "print(*sorted(m for m in sys.modules if m.startswith(prefixes)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split()
    assert "omni_rl.recipes.grpo_config" in loaded and all(m.endswith("config") for m in loaded), loaded


def test_train_refuses_a_recipe_it_does_not_run(capsys):
    from omni_rl.cli import main

    assert main(["train", "configs/demo.yaml"]) == 2
    err = capsys.readouterr().err
    assert "recipe 'demo' is not trainable with 'omni-rl train' (run it with omni-rl demo --config)" in err
    assert "trainable: flow_ppo, grpo, sft" in err
    assert main(["quickstart", "--config", "configs/demo.yaml"]) == 2
    assert "recipe 'demo' is not 'quickstart'" in capsys.readouterr().err


# ---------------------------------------------------------------------- section defaults


def test_a_partial_section_keeps_the_fields_default():
    # quickstart_sim's ppo default has actor_lr 5e-5 (PPOConfig's own default is 3e-4)
    cfg = load_config(None, ["ppo.epochs=2", "run.output_dir=x"], recipe="quickstart_sim")
    assert cfg.ppo.epochs == 2 and cfg.ppo.actor_lr == 5e-5 and cfg.ppo.critic_warmup == 20
    assert cfg.run.output_dir == "x" and cfg.run.threads == 2 and cfg.run.name == "quickstart_sim"
    assert cfg.run.cpu_kernels == "avx2"  # its seed rows come back on machines without AVX-512
    # a Choice section keeps its default's type and values unless 'type' changes it
    cfg = load_config(None, ["optimizer.weight_decay=0.1"], recipe="demo")
    assert isinstance(cfg.optimizer, AdamWConfig) and cfg.optimizer.lr == 1e-3
    cfg = load_config(None, ["optimizer.type=sgd"], recipe="demo")
    assert isinstance(cfg.optimizer, SGDConfig) and cfg.optimizer.lr == SGDConfig().lr


# ------------------------------------------------------------------------ the quickstart


def test_quickstart_composes_the_recipes_configs():
    from omni_rl.demos.quickstart_config import QuickstartConfig
    from omni_rl.recipes.grpo_config import GRPOConfig
    from omni_rl.recipes.sft_config import SFTConfig

    cfg = load_config("configs/quickstart.yaml")
    assert cfg == load_config(None, recipe="quickstart") and isinstance(cfg, QuickstartConfig)
    assert isinstance(cfg.sft, SFTConfig) and isinstance(cfg.grpo, GRPOConfig)
    s, g = cfg.sft, cfg.grpo
    assert (s.trainer.steps, s.optimizer.lr, s.data.prompts_per_step) == (400, 5e-4, 8)
    assert isinstance(s.optimizer, AdamWConfig) and isinstance(g.optimizer, AdamWConfig)
    assert (g.trainer.steps, g.optimizer.lr, g.data.prompts_per_step) == (800, 2e-4, 8)
    assert (g.rollout.n, g.rollout.max_new_tokens, g.rollout.temperature) == (8, 32, 1.0)
    assert g.algorithm.kl_coef == 0.05
    assert (g.algorithm.advantage, g.algorithm.dynamic_sampling, g.rewards.template) == ("grpo", False, "answer_only")
    cfg = load_config("configs/quickstart.yaml", ["grpo.optimizer.lr=1e-4", "sft.trainer.steps=50"])
    assert cfg.grpo.optimizer.lr == 1e-4 and cfg.grpo.trainer.steps == 800
    assert cfg.sft.trainer.steps == 50 and cfg.sft.optimizer.lr == 5e-4
    with pytest.raises(ConfigError, match=r"grpo\.media: the quickstart fills this"):
        load_config(None, ["grpo.media.fps=1"], recipe="quickstart")
    with pytest.raises(ConfigError, match=r"sft\.data\.train: the quickstart fills this"):
        load_config(None, ["sft.data.train=x.jsonl"], recipe="quickstart")
    # the message names what to set instead
    with pytest.raises(ConfigError, match=r"sft\.model\.tiny_width: the quickstart fills this: set model\.width"):
        load_config(None, ["sft.model.tiny_width=96"], recipe="quickstart")
    with pytest.raises(ConfigError, match=r"fills this: set model\.audio_seconds instead"):
        load_config(None, ["grpo.model.tiny_audio_seconds=3"], recipe="quickstart_audio")


@pytest.mark.parametrize("recipe", ["quickstart", "quickstart_audio"])
@pytest.mark.parametrize("phase", ["sft", "grpo"])
def test_quickstart_refuses_a_best_model_chosen_on_its_held_out_set(recipe, phase):
    """The quickstarts' only evaluation set is the held-out set they report: a model
    chosen on it would inflate that figure, so the field is refused with that reason
    (not with the recipe's "names no eval set", which its section would raise)."""
    with pytest.raises(ConfigError, match=rf"{phase}\.trainer\.best_metric: .*held-out set the quickstart reports"):
        load_config(None, [f"{phase}.trainer.best_metric=eval/heldout/accuracy"], recipe=recipe)


def test_the_four_kind_quickstart_config_is_the_former_default():
    """configs/quickstart_four_kinds.yaml, which the earlier quickstart results ran:
    the four two-option kinds, 100 cold-start steps on a quarter of the clips without
    colour questions, 1,000 GRPO steps of up to 24 tokens."""
    cfg = load_config("configs/quickstart_four_kinds.yaml")
    d = cfg.data
    assert d.kinds == ["direction", "order", "count", "when"] and (d.train_clips, d.heldout_clips) == (800, 200)
    assert (d.sft_fraction, d.sft_shuffled_answers, d.sft_color_questions) == (0.25, True, False)
    assert cfg.sft.trainer.steps == 100 and cfg.grpo.trainer.steps == 1000 and cfg.grpo.rollout.max_new_tokens == 24
    default = load_config(None, recipe="quickstart")
    assert (cfg.run, cfg.media, cfg.model) == (default.run, default.media, default.model)
    assert (cfg.sft.optimizer, cfg.grpo.optimizer, cfg.grpo.algorithm) == (
        default.sft.optimizer,
        default.grpo.optimizer,
        default.grpo.algorithm,
    )


def test_quickstart_override_lands_in_the_grpo_runs_config(tmp_path, monkeypatch):
    from omni_rl.demos import quickstart

    ran = {}
    monkeypatch.setattr(quickstart.sft, "train", lambda cfg: ran.setdefault("sft", cfg))
    monkeypatch.setattr(quickstart.grpo, "train", lambda cfg: ran.setdefault("grpo", cfg))
    evaluation = {"accuracy": 0.5, "per_type": {}, "per_source": {}, "rows": 8, "row_accuracy": {}, "answers": {}}
    monkeypatch.setattr(quickstart, "_held_out", lambda *a: evaluation)
    monkeypatch.setattr(quickstart, "_plots", lambda out: None)
    monkeypatch.setattr(quickstart, "write_model_inputs", lambda *a: None)  # no SFT model to read a processor from
    monkeypatch.setattr(quickstart.checkpoint, "latest", lambda out: Path(out) / "checkpoints" / "step-1")
    overrides = [f"run.output_dir={tmp_path}", "data.train_clips=8", "data.heldout_clips=4"]
    cfg = load_config(None, [*overrides, "grpo.optimizer.lr=1e-4", "sft.trainer.steps=50"], recipe="quickstart")
    quickstart.main(cfg)
    sft_cfg, grpo_cfg = ran["sft"], ran["grpo"]
    assert grpo_cfg.optimizer.lr == 1e-4 and grpo_cfg.trainer.steps == 800 and grpo_cfg.rollout.n == 8
    assert sft_cfg.trainer.steps == 50 and sft_cfg.optimizer.lr == 5e-4
    # each phase owns its folder: a rerun of the quickstart starts it afresh
    assert grpo_cfg.run == dataclasses.replace(cfg.run, output_dir=str(tmp_path / "grpo"), overwrite=True)
    assert grpo_cfg.media == cfg.media and sft_cfg.media == cfg.media
    assert grpo_cfg.model.path == str(tmp_path / "sft" / "checkpoints" / "step-1" / "model")
    assert sft_cfg.model.path is None and (sft_cfg.model.tiny_family, sft_cfg.model.tiny_width) == ("qwen2_5_vl", 128)
    assert sft_cfg.data.train == str(tmp_path / "data" / "train" / "sft.jsonl")
    assert grpo_cfg.data.cache == str(tmp_path / "cache") and grpo_cfg.data.prompts_per_step == 8
    # the run's resolved config loads back as a grpo config with the override
    path = save_config(grpo_cfg, tmp_path / "grpo.yaml")
    assert load_config(path).optimizer.lr == 1e-4
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["grpo"]["optimizer"]["type"] == "adamw" and saved["grpo"]["optimizer"]["lr"] == 1e-4


# ------------------------------------------------------------------------------- data


def test_data_eval_sets_are_checked_when_the_config_loads():
    sets = "data.eval=[{data: held.jsonl}, {benchmark: mvbench, data: mv, protocol: {nframes: 8}}]"
    cfg = load_config(None, [sets], recipe="grpo")
    assert [e.name for e in cfg.data.eval] == ["held", "mvbench"]
    assert cfg.data.eval[1].protocol == {"nframes": 8}
    with pytest.raises(ConfigError, match=r"data\.eval\[0\]\.benchmark: known presets: .*mvbench"):
        load_config(None, ["data.eval=[{benchmark: mvbenchh, data: mv}]"], recipe="grpo")
    with pytest.raises(ConfigError, match=r"nframez: unknown key .*did you mean 'nframes'"):
        load_config(None, ["data.eval=[{benchmark: mvbench, data: mv, protocol: {nframez: 8}}]"], recipe="sft")
    with pytest.raises(ConfigError, match=r"protocol: applies to a benchmark preset only"):
        load_config(None, ["data.eval=[{data: held.jsonl, protocol: {nframes: 8}}]"], recipe="grpo")
    # a preset answers by its protocol: the rows' settings would be taken and ignored
    with pytest.raises(ConfigError, match=r"data\.eval\[0\]\.max_new_tokens: rows only: .*protocol\.max_new_tokens"):
        load_config(None, ["data.eval=[{benchmark: mvbench, data: mv, max_new_tokens: 8}]"], recipe="grpo")
    with pytest.raises(ConfigError, match=r"data\.eval\[0\]\.samples: rows only"):
        load_config(None, ["data.eval=[{benchmark: mvbench, data: mv, samples: 4}]"], recipe="grpo")
    with pytest.raises(ConfigError, match=r"two eval sets share a name"):
        load_config(None, ["data.eval=[{data: a/held.jsonl}, {data: b/held.jsonl}]"], recipe="grpo")
    with pytest.raises(ConfigError, match=r"trainer\.best_metric: 'eval/other/accuracy' names no eval set"):
        load_config(None, ["data.eval=[{data: held.jsonl}]", "trainer.best_metric=eval/other/accuracy"], recipe="grpo")


def test_grpo_without_data_train_fails_before_training_starts(tmp_path, capsys):
    from omni_rl.cli import main

    cfg = load_config(None, [f"run.output_dir={tmp_path}"], recipe="grpo")  # loads: a default may lack data
    assert cfg.data.train == ""
    path = tmp_path / "grpo.yaml"
    path.write_text(f"recipe: grpo\nrun:\n  output_dir: {tmp_path / 'run'}\n  threads: 2\n")
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"omni-rl: error: {path}: missing inputs: data.train: unset: must name a file" in err
    assert not (tmp_path / "run").exists()  # found before the run made its output_dir


def test_freezing_a_vision_tower_that_is_not_there_is_refused(tmp_path):
    """model.freeze_vision_tower froze nothing on an audio model (no parameter named
    'visual') and nothing more under LoRA (the adapters train the language model only,
    the rest frozen already), without a word."""
    from omni_rl.models import build_tiny, load
    from omni_rl.recipes.common import freeze_vision_tower

    with pytest.raises(ConfigError, match=r"model\.freeze_vision_tower: does nothing with model\.lora"):
        load_config(None, ["model.freeze_vision_tower=true", "model.lora={rank: 4}"], recipe="grpo")
    model, _ = load(build_tiny("qwen2_audio", tmp_path / "audio", audio_seconds=2))
    with pytest.raises(OmniRLError, match=r"model\.freeze_vision_tower: .*Qwen2AudioForConditionalGeneration has no"):
        freeze_vision_tower(model)
    model, _ = load(build_tiny("qwen2_5_vl", tmp_path / "vl"))
    frozen = freeze_vision_tower(model)
    assert frozen > 0 and frozen == sum(not p.requires_grad for p in model.parameters())


def test_tiny_model_settings_beside_a_checkpoint_path_are_refused():
    """model.tiny_family, tiny_width and tiny_audio_seconds were taken beside
    model.path and did nothing: the checkpoint is loaded, no tiny model built."""
    with pytest.raises(ConfigError, match=r"model\.tiny_width: does nothing under model\.path"):
        load_config(None, ["model.path=ckpt", "model.tiny_width=4096"], recipe="grpo")
    with pytest.raises(ConfigError, match=r"model\.tiny_family: does nothing under model\.path.*tiny_audio_seconds"):
        load_config(None, ["model.path=p", "model.tiny_family=qwen2_audio", "model.tiny_audio_seconds=2"], recipe="sft")
    tiny = load_config(None, ["model.tiny_width=128"], recipe="grpo").model
    assert (tiny.family(), tiny.setting("tiny_width"), tiny.setting("tiny_audio_seconds")) == ("qwen2_5_vl", 128, 30)
