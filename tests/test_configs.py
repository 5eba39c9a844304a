"""Every Hydra config in conf/ composes into a valid TrainConfig; bad values fail naming the field.

Config files are discovered by globbing conf/, so a new option, experiment or sweep is covered
without touching this file. Composition uses Hydra's compose API on the repository's conf/ (no
install needed); one test runs a real ``hydra.main`` app against ``pkg://fsdp_speedloader.conf``
to check the installed package (editable or not) exposes the same configs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import itertools
import json
import re
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue

from fsdp_speedloader.app.config import TrainConfig

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
OUTPUT_DIR = "/tmp/fsdp_speedloader_test_run"  # replaces ${hydra:runtime.output_dir}, set only in a real run

# Groups whose files are `# @package _global_` (they override keys anywhere); every other group is a
# TrainConfig field and its files hold exactly that dataclass's keys.
GLOBAL_GROUPS = ("experiment", "sweep")
GROUPS = sorted(p.name for p in CONF_DIR.iterdir()
                if p.is_dir() and p.name != "hydra" and any(p.glob("*.yaml")))
OPTIONS = [(g, f.stem) for g in GROUPS for f in sorted((CONF_DIR / g).glob("*.yaml"))]
FIELD_GROUPS = [g for g in GROUPS if g not in GLOBAL_GROUPS]
SUB_CONFIGS = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)
               if dataclasses.is_dataclass(f.default_factory)}


def compose_cfg(overrides=(), *, return_hydra_config: bool = False):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=[*overrides, f"output_dir={OUTPUT_DIR}"],
                       return_hydra_config=return_hydra_config)


def compose_filled(overrides: list[str]):
    """Composes, giving every mandatory ``???`` a value (only data paths have them)."""
    cfg = compose_cfg(overrides)
    missing = sorted(OmegaConf.missing_keys(cfg))
    if not missing:
        return cfg
    unexpected = [k for k in missing if not k.endswith(".path") and k != "data.mixture"]
    assert not unexpected, f"mandatory values other than paths: {unexpected}; teach compose_filled about them"
    fill = {"data.mixture": "[{path: /placeholder/a, weight: 1}]"}
    return compose_cfg([*overrides, *(f"{k}={fill.get(k, f'/placeholder/{k}')}" for k in missing)])


def to_train_config(cfg) -> TrainConfig:
    """What the entry point does: resolve, drop Hydra's own node, validate."""
    d = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    d.pop("hydra", None)
    return TrainConfig.from_dict(d)


def check_types(obj, prefix: str = "") -> None:
    """Every value has its field's annotated type (YAML gives strings for e.g. '1e-5' in some loaders)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_types(value, f"{name}.")
            continue
        hint = hints[f.name]
        allowed = tuple(a for a in typing.get_args(hint) if a is not type(None)) or (hint,)
        if value is None:
            assert type(None) in typing.get_args(hint), f"{name} is null but not Optional"
            continue
        allowed = tuple(typing.get_origin(a) or a for a in allowed)
        if float in allowed:
            allowed += (int,)
        ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
        assert ok, f"{name}={value!r} ({type(value).__name__}) is not {hint}"


def load_yaml(group: str, option: str) -> dict:
    return yaml.safe_load((CONF_DIR / group / f"{option}.yaml").read_text()) or {}


# ---------------------------------------------------------------------------------------------
# Every config composes and validates
# ---------------------------------------------------------------------------------------------


def test_discovered_the_groups():
    assert set(GROUPS) >= {"model", "data", "optim", "schedule", "offload", "logger", "checkpoint",
                           "experiment", "sweep"}
    assert set(FIELD_GROUPS) <= set(SUB_CONFIGS), f"groups that are not TrainConfig fields: {set(FIELD_GROUPS) - set(SUB_CONFIGS)}"


def test_default_config():
    cfg = compose_cfg()
    tc = to_train_config(cfg)
    check_types(tc)
    assert (tc.model.name, tc.data.source, tc.optim.lr_schedule, tc.schedule.name, tc.offload.params,
            tc.logger.backend, tc.checkpoint.resume) == ("llama_tiny", "default", "cosine", "speedloader", False,
                                                         "wandb", None)
    assert tc.model.vocab_size >= 257, "the default byte tokenizer needs 257 token ids"
    assert tc.output_dir == OUTPUT_DIR
    raw = OmegaConf.load(CONF_DIR / "config.yaml")
    assert OmegaConf.to_container(raw, resolve=False)["output_dir"] == "${hydra:runtime.output_dir}"


def test_config_yaml_sets_every_top_level_field():
    raw = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"), resolve=False)
    scalars = {f.name for f in dataclasses.fields(TrainConfig)} - set(SUB_CONFIGS)
    assert set(raw) - {"defaults", "hydra"} == scalars


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes(group, option):
    tc = to_train_config(compose_filled([f"{group}={option}"]))
    check_types(tc)
    if group == "model":
        assert tc.model.name == option, "model.name should be the option's name (it labels runs)"


@pytest.mark.parametrize("group,option", [(g, o) for g, o in OPTIONS if g in FIELD_GROUPS],
                         ids=[f"{g}={o}" for g, o in OPTIONS if g in FIELD_GROUPS])
def test_group_file_holds_exactly_its_dataclass_keys(group, option):
    keys = set(load_yaml(group, option))
    expected = {f.name for f in dataclasses.fields(SUB_CONFIGS[group])}
    assert keys == expected, f"missing {sorted(expected - keys)}, unknown {sorted(keys - expected)}"


@pytest.mark.parametrize("group,option", [(g, o) for g, o in OPTIONS if g in GLOBAL_GROUPS],
                         ids=[f"{g}={o}" for g, o in OPTIONS if g in GLOBAL_GROUPS])
def test_global_file_starts_with_package_header(group, option):
    first = (CONF_DIR / group / f"{option}.yaml").read_text().splitlines()[0]
    assert first.strip() == "# @package _global_"


@pytest.mark.parametrize("experiment", [o for g, o in OPTIONS if g == "experiment"])
def test_experiment_with_sweep_composes(experiment):
    for sweep in [o for g, o in OPTIONS if g == "sweep"]:
        check_types(to_train_config(compose_filled([f"experiment={experiment}", f"sweep={sweep}"])))


def test_llama2_7b_offload_experiment():
    tc = to_train_config(compose_cfg(["experiment=llama2_7b_offload"]))
    assert (tc.model.name, tc.model.hidden_size, tc.model.num_layers) == ("llama2_7b", 4096, 32)
    assert (tc.data.source, tc.data.seq_len) == ("synthetic", 4096)
    assert tc.offload.params
    assert (tc.schedule.name, tc.schedule.sub_batch_size, tc.schedule.num_sub_batches) == ("speedloader", 1, 8)


def test_llama2_70b_fits_a_4_gpu_node_host():
    """experiment=llama2_70b_4gpu: the host-memory plan of 4 ranks (each holding a quarter of the shards) stays under
    the 512 GiB of the lent 4-GPU machine with room to spare, and the settings it names are what frees it: fp32
    moments, or int8 moments with the activations on the host, would not fit."""
    from fsdp_speedloader.app.host_memory import host_memory_plan
    from fsdp_speedloader.models import build_model

    def four_ranks_gib(overrides: list[str]) -> float:
        tc = to_train_config(compose_cfg(["experiment=llama2_70b_4gpu", *overrides]))
        plan, _ = host_memory_plan(build_model(tc.model, device="meta"), tc, shards=4)
        return 4 * plan.total / 2**30

    tc = to_train_config(compose_cfg(["experiment=llama2_70b_4gpu"]))
    assert (tc.model.name, tc.model.num_layers, tc.data.source) == ("llama2_70b", 80, "default")
    assert (tc.schedule.num_sub_batches, tc.schedule.compile_blocks, tc.optim.lr) == (4, True, 1.5e-5)  # as measured
    assert four_ranks_gib([]) < 420
    assert four_ranks_gib(["optim.state_dtype=fp32"]) > 512
    # the activations of 8 sub-batches on the host instead of 4 on the GPU
    assert four_ranks_gib(["schedule.activation_store=host", "schedule.num_sub_batches=8"]) > 512


def test_command_line_overrides_beat_experiments():
    tc = to_train_config(compose_cfg(["experiment=llama2_7b_offload", "schedule.num_sub_batches=4"]))
    assert tc.schedule.num_sub_batches == 4


def _sweep_points(params: dict) -> list[list[str]]:
    """The override lists Hydra's basic sweeper runs for ``hydra.sweeper.params`` (cartesian product)."""
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    axes = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
            else [f"{o.get_key_element()}={o.get_value_element_as_str()}"] for o in parsed]
    return [list(p) for p in itertools.product(*axes)]


@pytest.mark.parametrize("sweep", [o for g, o in OPTIONS if g == "sweep"])
def test_every_sweep_point_is_valid(sweep):
    cfg = compose_cfg([f"sweep={sweep}"], return_hydra_config=True)
    params = OmegaConf.to_container(cfg.hydra.sweeper.params)
    assert params, f"sweep/{sweep}.yaml sets no hydra.sweeper.params"
    points = _sweep_points(params)
    assert len(points) >= 2
    for point in points:
        tc = to_train_config(compose_cfg([f"sweep={sweep}", *point]))
        assert tc.logger.group, "a sweep should put its runs in one logger.group"
        for override in point:
            key, value = override.split("=", 1)
            assert str(functools.reduce(getattr, key.split("."), tc)) == value


# ---------------------------------------------------------------------------------------------
# Bad values fail with a ValueError naming the field
# ---------------------------------------------------------------------------------------------

BAD = [
    (["schedule.num_sub_batches=0"], "schedule.num_sub_batches"),
    (["schedule.sub_batch_size=-1"], "schedule.sub_batch_size"),
    (["schedule.name=foo"], "schedule.name"),
    (["schedule.activation_store=disk"], "schedule.activation_store"),
    (["schedule.target_batch_size=4"], "schedule.target_batch_size"),  # the tuner's cap, without schedule=auto
    (["schedule=canonical", "schedule.tune_blocks_per_unit=[1,2]"], "schedule.tune_blocks_per_unit"),
    (["model.hidden_size=100", "model.num_heads=3"], "model.hidden_size"),
    (["model=llama2_70b", "model.num_kv_heads=7"], "model.num_kv_heads"),
    (["model.family=gpt2"], "model.family"),
    (["data.seq_len=4096"], "data.seq_len"),  # llama_tiny accepts at most 2048 positions
    (["optim.lr=0"], "optim.lr"),
    (["logger.backend=tensorboard"], "logger.backend"),
    (["checkpoint.keep_last=0"], "checkpoint.keep_last"),
    (["checkpoint.resume=true"], "checkpoint.resume=auto"),  # Hugging Face's resume_from_checkpoint=True: say which
    (["steps=0"], "steps"),
    (["device=tpu"], "device"),
    (["+model.hiden_size=64"], "hiden_size"),  # unknown key in a group
    (["+learning_rate=1e-3"], "learning_rate"),  # unknown top-level key
]


@pytest.mark.parametrize("overrides,field_name", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_value_names_the_field(overrides, field_name):
    cfg = compose_cfg(overrides)
    with pytest.raises(ValueError, match=re.escape(field_name)):
        to_train_config(cfg)


def test_a_home_directory_in_a_path_key_is_expanded(monkeypatch, tmp_path):
    # quoted past Hydra's lexer, '~/x' was read as a directory named '~' (checkpoint.dir created ./~)
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = to_train_config(compose_cfg(["data=mixture", 'data.mixture=[{path: "~/web", weight: 1}]',
                                       "checkpoint.dir='~/ckpt'", "checkpoint.resume='~/ckpt/step_00000002'"]))
    assert cfg.data.mixture[0]["path"] == str(tmp_path / "web")
    assert (cfg.checkpoint.dir, cfg.checkpoint.resume) == (str(tmp_path / "ckpt"), str(tmp_path / "ckpt/step_00000002"))
    assert to_train_config(compose_cfg(["optim.lr=1e-3"])).checkpoint.resume is None


def test_every_dtype_key_takes_either_spelling():
    # param_dtype's choices are torch's names, optim.state_dtype's the short ones: each key takes both
    cfg = to_train_config(compose_cfg(["param_dtype=bf16", "reduce_dtype=fp32", "offload=params",
                                       "offload.param_transfer_dtype=bfloat16"]))
    assert (cfg.param_dtype, cfg.reduce_dtype, cfg.offload.param_transfer_dtype) == ("bfloat16", "float32", "bfloat16")
    cfg = to_train_config(compose_cfg(["offload=params", "optim.state_dtype=bfloat16", "optim.master_dtype=bfloat16"]))
    assert (cfg.optim.state_dtype, cfg.optim.master_dtype) == ("bf16", "bf16")
    with pytest.raises(ValueError, match="optim.state_dtype: got 'fp16'; choose one of 'fp32', 'bf16', 'int8'"):
        to_train_config(compose_cfg(["optim.state_dtype=fp16"]))  # a dtype the key does not take, in its spelling


def test_a_pretrained_checkpoints_text_is_read_with_its_own_tokenizer(tmp_path):
    # data.tokenizer's default (null) is model.path's tokenizer where the directory holds one: a Llama checkpoint
    # trained on byte ids would learn nothing it knows. Without one, or without model.path: bytes; a named one wins.
    with_tokenizer, without = tmp_path / "llama", tmp_path / "bare"
    for d in (with_tokenizer, without):
        d.mkdir()
        (d / "config.json").write_text("{}")
    (with_tokenizer / "tokenizer_config.json").write_text("{}")
    assert to_train_config(compose_cfg([f"model.path={with_tokenizer}"])).data.tokenizer == str(with_tokenizer)
    assert to_train_config(compose_cfg([f"model.path={without}"])).data.tokenizer == "bytes"
    assert to_train_config(compose_cfg([])).data.tokenizer == "bytes"
    assert to_train_config(compose_cfg([f"model.path={with_tokenizer}", "data.tokenizer=bytes"])).data.tokenizer == \
        "bytes"
    assert to_train_config(compose_cfg([f"model.path={with_tokenizer}", "data=text", "data.path=x.txt"])
                           ).data.tokenizer == str(with_tokenizer)


def test_checkpoint_resume_false_is_a_fresh_start():
    assert to_train_config(compose_cfg(["checkpoint.resume=false"])).checkpoint.resume is None
    assert to_train_config(compose_cfg(["checkpoint.resume=auto"])).checkpoint.resume == "auto"


def test_the_tuners_budgets_are_read_under_schedule_auto_only():
    # Under a hand-set schedule they would be ignored silently: refused with what to change, before anything runs.
    with pytest.raises(ValueError, match=r"target_batch_size=4, max_sub_batch_size=2 applies to schedule=auto only.*"
                                         r"runs sub_batch_size x num_sub_batches as given \(4 x 2\): add schedule=auto"):
        to_train_config(compose_cfg(["schedule.target_batch_size=4", "schedule.max_sub_batch_size=2"]))
    tc = to_train_config(compose_cfg(["schedule=auto", "schedule.target_batch_size=4",
                                      "schedule.gpu_memory_budget_gib=40"]))
    assert (tc.schedule.target_batch_size, tc.schedule.gpu_memory_budget_gib) == (4, 40.0)


def test_the_model_s_own_loss_is_a_canonical_choice_only():
    # 0: the canonical schedule leaves the head to the model's own loss; layer-major's head is always chunked
    assert to_train_config(compose_cfg(["schedule=canonical", "schedule.loss_chunk_tokens=0"])).schedule \
        .loss_chunk_tokens == 0
    with pytest.raises(ValueError, match="schedule.loss_chunk_tokens"):
        to_train_config(compose_cfg(["schedule.loss_chunk_tokens=0"]))


@pytest.mark.parametrize("data, key", [("text", "path"), ("tokens", "path"), ("mixture", "mixture")])
def test_missing_data_path_is_named(data, key):
    with pytest.raises(MissingMandatoryValue, match=rf"data\.{key}"):
        to_train_config(compose_cfg([f"data={data}"]))


# ---------------------------------------------------------------------------------------------
# The installed package: hydra.main(config_path="pkg://fsdp_speedloader.conf") in a real run
# ---------------------------------------------------------------------------------------------

APP = textwrap.dedent("""
    import json
    import hydra
    from omegaconf import OmegaConf
    from fsdp_speedloader.app.config import TrainConfig

    @hydra.main(version_base="1.3", config_path="pkg://fsdp_speedloader.conf", config_name="config")
    def main(cfg):
        d = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        tc = TrainConfig.from_dict(d)
        print("POINT " + json.dumps([tc.model.name, tc.schedule.sub_batch_size, tc.schedule.num_sub_batches,
                                     tc.logger.group, tc.output_dir]), flush=True)

    main()
""")


def _run_app(tmp_path: Path, *overrides: str) -> list[list]:
    if not _installed():
        pytest.skip("fsdp-speedloader is not installed (pip install -e .); pkg:// configs need the package")
    script = tmp_path / "app.py"
    script.write_text(APP)
    # cwd and sys.path[0] are tmp_path, so fsdp_speedloader comes from the installed package, not the checkout.
    proc = subprocess.run([sys.executable, str(script), *overrides], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [json.loads(line[len("POINT "):]) for line in proc.stdout.splitlines() if line.startswith("POINT ")]


def _installed() -> bool:
    try:
        importlib.metadata.distribution("fsdp-speedloader")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_installed_package_run(tmp_path):
    points = _run_app(tmp_path, "model=opt_6.7b", "logger=none", f"hydra.run.dir={tmp_path}/run")
    assert points == [["opt_6.7b", 4, 2, None, f"{tmp_path}/run"]]


def test_installed_package_sweep(tmp_path):
    points = _run_app(tmp_path, "sweep=sub_batches", "experiment=tiny_cpu", f"hydra.sweep.dir={tmp_path}/multirun")
    assert sorted((n, N) for _, n, N, _, _ in points) == sorted(itertools.product([1, 2, 4], [2, 4, 8]))
    assert {group for _, _, _, group, _ in points} == {"sweep_sub_batches"}
    assert len({out for *_, out in points}) == len(points)
    assert all(out.startswith(f"{tmp_path}/multirun/") for *_, out in points)
