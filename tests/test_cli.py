"""The command line of every entry point: a typo is one line naming the closest valid names (exit 2), and
``--help`` lists the entry point's own groups and points to docs/configuration.md.

The entry points' ``main()`` run in this process where they stop before Hydra runs a job (a refused override,
``--help``): the real argument handling (``launch``, ``cli.check_command_line``, Hydra's help with the
``conf/hydra/help/`` templates), in a fraction of a second each. The issue's own commands run as subprocesses of
``python -m fsdp_speedloader.app.train``: a key typo with and without ``+`` (the second reaches the dataclass).
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_speedloader.app.cli import check_overrides
from fsdp_speedloader.app.config import TrainConfig
from launch_utils import clean_env, tail

CONF = Path(__file__).resolve().parents[1] / "conf"
MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
TRAIN_GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra" and any(p.glob("*.yaml")))


def _main(monkeypatch, capsys, entry: str, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``python -m fsdp_speedloader.app.<entry> *args``, run in this process."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "FSDP_SPEEDLOADER_RUN_STAMP"):  # launch sets them: restored after
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", [f"fsdp_speedloader.app.{entry}", *args])
    module = importlib.import_module(f"fsdp_speedloader.app.{entry}")
    with pytest.raises(SystemExit) as exited:
        if entry == "sweep":
            sys.exit(module.main(list(args)))
        module.main()
    out, err = capsys.readouterr()
    return exited.value.code, out, err


def _error_line(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0][len("error: "):]


# --- typos: one line, exit 2, the closest names ---------------------------------------------------------------

TYPOS = [
    ("train", ["schedule.num_sub_bachtes=4"], "unknown key schedule.num_sub_bachtes: did you mean "
                                              "schedule.num_sub_batches?"),
    ("train", ["model=lama2_7b"], "unknown model=lama2_7b: did you mean llama2_7b? (options: "
                                  f"{', '.join(MODELS)})"),
    ("train", ["experiment=tiny_cpu", "num_sub_batches=4"], "unknown key num_sub_batches: did you mean "
                                                            "schedule.num_sub_batches?"),
    ("train", ["modle=llama2_7b"], "unknown key modle: did you mean model?"),
    ("tune", ["schedule.target_batch=8"], "unknown key schedule.target_batch: did you mean "
                                          "schedule.target_batch_size?"),
    ("generate", ["prompts.pth=prompts.txt"], "unknown key prompts.pth: did you mean prompts.path?"),
    ("generate", ["model=opt_tin"], "unknown model=opt_tin: did you mean opt_tiny? (options: "
                                    f"{', '.join(MODELS)})"),
    ("generate", ["experiment=tiny_cpu"], "experiment: conf/generate.yaml has no config group experiment (its "
                                          "groups: logger, model, offload)"),
    ("export", ["checkpoint=ckpt", "ot=hf"], "unknown key ot: did you mean out?"),
    ("generate", ["prompts=hello"], "prompts is a section, not a value: set one of its keys (prompts.source, "
                                    "prompts.path, prompts.text, prompts.text_field, prompts.num_prompts, "
                                    "prompts.prompt_len, prompts.min_prompt_len), e.g. prompts.source=..."),
    ("train", ["optim=0.1"], "optim=0.1: optim is a config group: name one of its options (adamw), or set a key "
                             "under it (optim.KEY=VALUE)"),
    ("sweep", ["sweep=sub_batchs", "experiment=tiny_cpu"], "unknown sweep=sub_batchs: did you mean sub_batches? "
                                                           "(options: sub_batches, sub_batches_units)"),
    ("sweep", ["experiment=tiny_cpu", "schedule.num_sub_bachtes=1,2"], "unknown key schedule.num_sub_bachtes: did "
                                                                       "you mean schedule.num_sub_batches?"),
]


@pytest.mark.parametrize("entry,args,line", TYPOS, ids=[f"{e} {' '.join(a)}" for e, a, _ in TYPOS])
def test_typo_is_one_line_with_the_closest_names(monkeypatch, capsys, tmp_path, entry, args, line):
    monkeypatch.chdir(tmp_path)  # nothing may be written: the run directory would be under here
    code, _, err = _main(monkeypatch, capsys, entry, *args)
    assert _error_line(code, err) == line
    assert not any(tmp_path.iterdir())


def test_every_option_of_a_swept_group_is_checked():
    check_overrides("config", ["model=llama2_7b,opt_tiny", "schedule.num_sub_batches=1,2"])
    with pytest.raises(ValueError, match=r"^unknown model=lama3_8b: did you mean llama3_8b\? \(options: "):
        check_overrides("config", ["model=llama2_7b,lama3_8b"])


def test_valid_command_lines_pass():
    """Experiments that change the defaults list, Hydra's own keys, additions, deletions and nulls are Hydra's."""
    check_overrides("config", ["experiment=llama2_7b_offload", "model=llama2_13b", "schedule=auto",
                               "schedule.gpu_memory_budget_gib=40", "data=text", "data.path=x.txt",
                               "hydra.run.dir=/tmp/x", "hydra/launcher=slurm", "+schedule.new_key=1", "~seed",
                               "experiment=null", "model.rope_scaling.factor=8"])
    check_overrides("generate", ["checkpoint_path=ckpt", "prompts.path=p.txt", "offload=params", "kv_cache=host"])
    check_overrides("export", ["checkpoint_path=ckpt", "out=hf", "dtype=bfloat16"])
    check_overrides("tune", ["experiment=tiny_cpu", "schedule.target_batch_size=8"])


@pytest.mark.parametrize("entry", ["config", "generate", "tune"])
def test_a_shape_beside_model_path_is_refused(entry):
    """model.path's config.json gives the shapes: a shape override beside it would be dropped without a word."""
    with pytest.raises(ValueError, match=r"^model\.num_layers: model\.path='/ckpt/llama' takes the model's shapes .*"
                                         r"drop it"):
        check_overrides(entry, ["model.path=/ckpt/llama", "model.num_layers=1"])
    check_overrides(entry, ["model.path=/ckpt/llama", "model.name=mine", "model.attn_implementation=eager"])
    check_overrides(entry, ["model.path=null", "model.num_layers=1"])
    check_overrides(entry, ["model.num_layers=1"])


def test_a_key_with_no_close_name_lists_the_keys_beside_it():
    with pytest.raises(ValueError) as raised:
        check_overrides("config", ["optim.learning_rate=1e-3"])
    assert str(raised.value).startswith("unknown key optim.learning_rate (the keys under optim: beta1, beta2, ")
    assert " lr, lr_schedule, " in str(raised.value)


def test_dataclass_names_the_closest_field():
    """``+key=value`` gets past Hydra (it adds the key): the typed config refuses it with the same suggestion."""
    with pytest.raises(ValueError, match=r"^unknown key schedule\.num_sub_bachtes: did you mean "
                                         r"schedule\.num_sub_batches\?$"):
        TrainConfig.from_dict({"schedule": {"num_sub_bachtes": 4}})
    with pytest.raises(ValueError, match=r"^unknown key zzz \(valid keys: checkpoint, data, device, "):
        TrainConfig.from_dict({"zzz": 1})


# --- --help: the entry point's own groups, a pointer to docs/configuration.md ------------------------------------

def _groups_in_help(out: str) -> list[str]:
    return sorted(m.group(1) for m in re.finditer(r"^  (\w+)=\S+ +options: ", out, flags=re.MULTILINE))


@pytest.mark.parametrize("entry,groups", [("train", TRAIN_GROUPS), ("tune", TRAIN_GROUPS),
                                          ("generate", ["logger", "model", "offload"]), ("export", [])])
def test_help_lists_the_entry_point_s_own_groups(monkeypatch, capsys, entry, groups):
    code, out, err = _main(monkeypatch, capsys, entry, "--help")
    assert code == 0, err
    assert _groups_in_help(out) == groups, out
    assert "docs/configuration.md" in out
    assert "Powered by Hydra" not in out and "== Config ==" not in out  # not Hydra's default dump
    assert "loss_chunk_tokens" not in out and "forward_prefetch" not in out  # short: the most used keys only
    if groups:  # every option of the model group, read from conf/
        assert re.search(r"^  model=llama_tiny +options: " + re.escape(", ".join(MODELS[:2])), out, re.MULTILINE)
        assert all(model in out for model in MODELS)


def test_help_shows_the_composed_values(monkeypatch, capsys):
    code, out, _ = _main(monkeypatch, capsys, "train", "experiment=tiny_cpu", "--help")
    assert code == 0
    assert "  experiment=tiny_cpu " in out and "steps=20  device=cpu" in out


def test_help_with_a_typo_is_refused(monkeypatch, capsys):
    code, _, err = _main(monkeypatch, capsys, "generate", "modle=opt_tiny", "--help")
    assert _error_line(code, err) == "unknown key modle: did you mean model?"


def test_sweep_help_points_to_the_training_help_and_the_docs(monkeypatch, capsys):
    code, out, _ = _main(monkeypatch, capsys, "sweep", "--help")
    assert code == 0
    assert "python -m fsdp_speedloader.app.train --help" in out and "docs/configuration.md" in out


# --- the commands, as a user runs them --------------------------------------------------------------------

@pytest.fixture(scope="module")
def typo_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    root = tmp_path_factory.mktemp("cli")
    cases = {"plain": "schedule.num_sub_bachtes=4", "plus": "+schedule.num_sub_bachtes=4"}
    procs = {}
    for name, override in cases.items():
        cwd = root / name
        cwd.mkdir()
        procs[name] = subprocess.Popen([sys.executable, "-m", "fsdp_speedloader.app.train", "experiment=tiny_cpu",
                                        override], cwd=cwd, env=clean_env(cwd), stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    done = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


@pytest.mark.parametrize("case", ["plain", "plus"])
def test_train_key_typo_in_a_subprocess(typo_runs, case):
    run = typo_runs[case]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2, tail(run.stdout + run.stderr)
    assert errors == ["error: unknown key schedule.num_sub_bachtes: did you mean schedule.num_sub_batches?"], \
        tail(run.stderr)
    assert "Traceback" not in run.stderr and "HYDRA_FULL_ERROR" not in run.stderr, tail(run.stderr)
