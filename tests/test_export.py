"""Train -> generate -> export: a training checkpoint is a model, for generation and for Hugging Face.

Tiny LLaMA (with a Hugging Face tokenizer of its own) and tiny OPT (tied embeddings, the byte tokenizer) train
2 steps with the real trainer; their checkpoints must carry the model (config.json, model_config.json, the
tokenizer), export to directories that ``AutoModelForCausalLM.from_pretrained`` loads with the trained weights
bit for bit, and generate from ``checkpoint=PATH`` the tokens Hugging Face's greedy ``generate`` gives on the
export. A checkpoint written by 2 gloo ranks exports in one process; a sharded export reads one shard at a time;
a non-empty output directory is refused before anything is read.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

import fsdp_speedloader.app.export as export_mod
from dist_utils import run_distributed, tiny_config
from fsdp_speedloader.app.export import ExportConfig, export_checkpoint, open_checkpoint, parse_size
from fsdp_speedloader.app.trainer import Trainer
from launch_utils import REPO, clean_env

TEXT = " ".join(f"The {w} of line {i} is {w[::-1]}." for i in range(40) for w in ("cat", "river", "stone"))


def _tokenizer_dir(path: Path) -> Path:
    """A byte-level BPE tokenizer of 300 ids with an EOS, as a local Hugging Face directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(path)
    return path


def _full_state(model: torch.nn.Module) -> dict:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


BATCH = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))


def _train(root: Path, family: str) -> dict:
    """2 layer-major steps with a checkpoint after each; the trained weights and the trained model's loss on BATCH."""
    overrides = {"model": {"family": family, "tie_word_embeddings": family == "opt", "dropout": 0.0}, "steps": 2,
                 "checkpoint": {"every": 1, "keep_last": 2, "dir": str(root / "ckpt")}}
    if family == "qwen3_moe":  # a mixture of experts, its load-balancing loss on: HF's fused expert layout out
        overrides["model"].update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                  output_router_logits=True, router_aux_loss_coef=0.1)
    if family == "llama":  # a run with a Hugging Face tokenizer: its files travel with the checkpoint
        (root / "corpus.txt").write_text(TEXT)
        overrides["data"] = {"source": "text", "path": str(root / "corpus.txt"),
                             "tokenizer": str(_tokenizer_dir(root / "tokenizer"))}
    trainer = Trainer(tiny_config(root / "run", **overrides))
    trainer.train()
    with torch.no_grad():
        loss = trainer.model(input_ids=BATCH, labels=BATCH).loss.item()
    return {"cfg": trainer.cfg, "state": _full_state(trainer.model), "loss": loss, "ckpt": root / "ckpt"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {f: _train(tmp_path_factory.mktemp(f), f) for f in ("llama", "opt", "qwen3_moe")}
    finally:
        torch.set_num_threads(threads)


def _assert_weights(out: Path, state: dict, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()
    loaded = model.state_dict()
    assert set(loaded) == set(state)
    for name, value in state.items():  # bit for bit (in the export dtype)
        assert torch.equal(loaded[name], value.to(dtype)), name
    return model


# --- the checkpoint carries its model ------------------------------------------------------------------------------


def test_every_step_carries_its_model_and_the_newest_complete_one_is_found(trained):
    llama, opt = trained["llama"], trained["opt"]
    for run in (llama, opt):
        for step in ("step_00000001", "step_00000002"):
            record = json.loads((run["ckpt"] / step / "model_config.json").read_text())
            assert record["model"] == json.loads(json.dumps(dataclasses.asdict(run["cfg"].model)))
            assert json.loads((run["ckpt"] / step / "config.json").read_text())["model_type"] == run["cfg"].model.family
    assert json.loads((llama["ckpt"] / "step_00000002" / "model_config.json").read_text())["tokenizer"] == "tokenizer"
    assert (llama["ckpt"] / "step_00000002" / "tokenizer" / "tokenizer.json").is_file()
    assert json.loads((opt["ckpt"] / "step_00000002" / "model_config.json").read_text())["tokenizer"] == "bytes"
    assert not (opt["ckpt"] / "step_00000002" / "tokenizer").exists()

    (opt["ckpt"] / "step_00000009.tmp").mkdir(exist_ok=True)  # a save cut short
    (opt["ckpt"] / "step_00000010").mkdir(exist_ok=True)  # no DCP metadata: not complete
    ckpt = open_checkpoint(opt["ckpt"])
    assert ckpt.step_dir == opt["ckpt"] / "step_00000002" and ckpt.step == 2 and ckpt.tokenizer == "bytes"
    assert open_checkpoint(opt["ckpt"] / "step_00000001").step == 1
    assert (ckpt.model.family, ckpt.model.name, ckpt.model.path) == ("opt", "llama_tiny", str(ckpt.step_dir))
    assert open_checkpoint(llama["ckpt"]).tokenizer == str(llama["ckpt"] / "step_00000002" / "tokenizer")

    with pytest.raises(ValueError, match="checkpoint: .*missing.* does not exist"):
        open_checkpoint(opt["ckpt"] / "missing")
    with pytest.raises(ValueError, match=r"unfinished save \(\*.tmp\)"):
        open_checkpoint(opt["ckpt"] / "step_00000009.tmp")


def test_checkpoint_without_its_model_is_refused_naming_it(trained, tmp_path):
    step = tmp_path / "step_00000004"  # complete, as written before the model travelled with it
    shutil.copytree(trained["opt"]["ckpt"] / "step_00000001", step)
    (step / "model_config.json").unlink()
    (step / "config.json").unlink()
    with pytest.raises(ValueError, match="step_00000004 has no model_config.json"):
        open_checkpoint(tmp_path)


# --- export ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "opt", "qwen3_moe"])
def test_export_loads_in_hugging_face_with_the_trained_weights(trained, tmp_path, family, caplog):
    run = trained[family]
    with caplog.at_level("INFO", logger="fsdp_speedloader.app.export"):
        out = export_checkpoint(run["ckpt"], tmp_path / "hf")
    names = sorted(p.name for p in out.iterdir())
    tokenizer_files = ["tokenizer.json", "tokenizer_config.json"]
    assert "model.safetensors" in names and "model.safetensors.index.json" not in names
    assert set(tokenizer_files) <= set(names) if family == "llama" else not set(tokenizer_files) & set(names)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [{"llama": "LlamaForCausalLM", "opt": "OPTForCausalLM",
                                        "qwen3_moe": "Qwen3MoeForCausalLM"}[family]]
    assert config["dtype"] == "float32"
    assert f"({config['architectures'][0]}) to {out}" in caplog.text  # the log names what was exported

    model = _assert_weights(out, run["state"])
    with torch.no_grad():
        logits = model(input_ids=BATCH).logits
        loss = model(input_ids=BATCH, labels=BATCH).loss.item()
        # The Python API's unsharded model: the same weights, the same logits.
        assert torch.equal(open_checkpoint(run["ckpt"]).build_model()(input_ids=BATCH).logits, logits)
    assert loss == pytest.approx(run["loss"], rel=1e-5)  # the trained (layer-major) model's own loss
    if family == "llama":
        original = AutoTokenizer.from_pretrained(run["ckpt"].parent / "tokenizer")
        assert AutoTokenizer.from_pretrained(out).encode(TEXT[:200]) == original.encode(TEXT[:200])


class _ForcedTokens(LogitsProcessor):
    """Step k of Hugging Face's generate takes ``tokens[k]``: a tiny trained model would not end on its own."""

    def __init__(self, tokens: list[int], prompt_len: int) -> None:
        self.tokens, self.prompt_len = tokens, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.tokens[input_ids.shape[1] - self.prompt_len]] = 0.0
        return forced


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_hugging_face_generate_on_the_export_stops_at_the_run_tokenizers_eos(trained, tmp_path, family):
    """config.json and generation_config.json carry the run's tokenizer's special tokens (the byte tokenizer's EOS is
    256; the local tokenizer's are its own), not the config class's defaults: HF's generate stops at the real EOS and
    never at '!'."""
    out = export_checkpoint(trained[family]["ckpt"], tmp_path / "hf")
    if family == "llama":  # a local Hugging Face tokenizer: EOS '</s>', no BOS, no pad
        tokenizer = AutoTokenizer.from_pretrained(out)
        special = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
        bang = tokenizer.convert_tokens_to_ids("!")
    else:  # the byte tokenizer: EOS 256 only
        special, bang = (None, 256, None), ord("!")
    eos = special[1]
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == special
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    generation = model.generation_config
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (special[0], eos, eos)
    assert eos is not None and bang != eos

    prompt = BATCH[:1, :8]
    forced = LogitsProcessorList([_ForcedTokens([bang, bang, eos, bang, bang], prompt.shape[1])])
    got = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5,
                         do_sample=False, logits_processor=forced)
    assert got[0, prompt.shape[1]:].tolist() == [bang, bang, eos]  # on past '!', stopped at the EOS
    built = open_checkpoint(trained[family]["ckpt"]).build_model()  # the Python API's model says the same
    assert (built.generation_config.eos_token_id, built.generation_config.pad_token_id) == (eos, eos)
    assert (built.config.bos_token_id, built.config.eos_token_id, built.config.pad_token_id) == special


@pytest.mark.parametrize("tokenizer", ["own", "bytes"])
def test_model_paths_generation_config_goes_through_training_to_the_export(tmp_path, tokenizer, caplog):
    """An instruct model's generation_config.json (several EOS ids, sampling defaults) was lost through train ->
    export: Hugging Face's generate on the export ran past <|eot_id|>. Kept now; trained with another tokenizer,
    its special tokens are that tokenizer's."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    src = _tokenizer_dir(tmp_path / "src")
    eos = AutoTokenizer.from_pretrained(src).eos_token_id
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 vocab_size=320, max_position_embeddings=64)).save_pretrained(src)
    GenerationConfig(eos_token_id=[eos, 5], do_sample=True, temperature=0.6, top_p=0.9).save_pretrained(src)
    data = {"tokenizer": None} if tokenizer == "own" else {"tokenizer": "bytes"}
    with caplog.at_level("WARNING"):
        Trainer(tiny_config(tmp_path / "run", steps=1, model={"path": str(src)}, data=data,
                            checkpoint={"dir": str(tmp_path / "ckpt"), "save_final": True})).train()
    warned = [r.getMessage() for r in caplog.records if "is not model.path's own tokenizer" in r.getMessage()]
    assert warned == ([] if tokenizer == "own" else [  # another tokenizer for a pretrained model: said
        "data.tokenizer 'bytes' (257 tokens, EOS 256) is not model.path's own tokenizer (300 tokens, EOS 1): the "
        "pretrained model learns new meanings for its ids, and the checkpoint and its export carry 'bytes'"])
    out = json.loads((export_checkpoint(tmp_path / "ckpt", tmp_path / "hf") / "generation_config.json").read_text())
    assert (out["do_sample"], out["temperature"], out["top_p"]) == (True, 0.6, 0.9)
    expected = [eos, 5] if tokenizer == "own" else 256  # the byte tokenizer's: the source's ids are BPE tokens
    assert (out["eos_token_id"], out["pad_token_id"]) == (expected, eos if tokenizer == "own" else 256)


def test_sharded_export_holds_one_shard_at_a_time(trained, tmp_path, monkeypatch):
    run = trained["llama"]
    requested = []
    real_load = export_mod.dcp.load

    def recording_load(state_dict, **kwargs):
        requested.append(sum(t.numel() * t.element_size() for t in state_dict["model"].values()))
        return real_load(state_dict, **kwargs)

    monkeypatch.setattr(export_mod.dcp, "load", recording_load)
    out = export_checkpoint(run["ckpt"], tmp_path / "hf", max_shard_size="30KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 3 and files == sorted(set(index["weight_map"].values()))
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == set(run["state"])
    largest = max(t.numel() * 4 for t in run["state"].values())
    assert len(requested) == len(files) and max(requested) <= max(30_000, largest)  # one shard per DCP read
    assert index["metadata"]["total_size"] == sum(requested)
    _assert_weights(out, run["state"])

    half = export_checkpoint(run["ckpt"], tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    assert (half / "model.safetensors").stat().st_size < 0.6 * index["metadata"]["total_size"]
    _assert_weights(half, run["state"], torch.bfloat16)


def test_export_of_a_checkpoint_written_by_2_ranks_in_one_process(tmp_path):
    per_rank = run_distributed(_train_on_ranks, 2, str(tmp_path))
    step = tmp_path / "ckpt" / "step_00000002"
    assert (step / "__0_0.distcp").is_file() and (step / "__1_0.distcp").is_file()  # each rank wrote its shards
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", max_shard_size="40KB")
    assert (out / "model.safetensors.index.json").is_file()
    _assert_weights(out, per_rank[0])


def _train_on_ranks(rank: int, world_size: int, root: str) -> dict:
    trainer = Trainer(tiny_config(Path(root) / "run", steps=2,
                                  checkpoint={"dir": str(Path(root) / "ckpt"), "save_final": True}))
    trainer.train()
    return _full_state(trainer.model)


def test_non_empty_out_is_refused_before_anything_is_read(trained, tmp_path, monkeypatch):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")

    def no_reading(*args, **kwargs):
        raise AssertionError("the checkpoint was read before out was checked")

    with monkeypatch.context() as m:
        m.setattr(export_mod, "open_checkpoint", no_reading)
        m.setattr(export_mod.dcp, "load", no_reading)
        with pytest.raises(ValueError, match="out: .*mine is not empty; .*overwrite=true"):
            export_checkpoint(trained["opt"]["ckpt"], out)
        with pytest.raises(ValueError, match="out: .*notes.txt is a file"):
            export_checkpoint(trained["opt"]["ckpt"], out / "notes.txt")
        with pytest.raises(ValueError, match="out: cannot write to .*notes.txt/hf'.*notes.txt' is a file"):
            export_checkpoint(trained["opt"]["ckpt"], out / "notes.txt" / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]

    # overwrite=true: an earlier (sharded) export's files go, the user's stay.
    export_checkpoint(trained["opt"]["ckpt"], out, overwrite=True, max_shard_size="30KB")
    assert (out / "model.safetensors.index.json").is_file()
    # an earlier export's tokenizer (another vocabulary) left beside this byte-tokenizer model loaded as its own
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / name).write_text("{}")
    export_checkpoint(trained["opt"]["ckpt"], out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                    "notes.txt"]
    assert (out / "notes.txt").read_text() == "keep me"
    _assert_weights(out, trained["opt"]["state"])
    with pytest.raises(ValueError, match="inside the checkpoint"):
        export_checkpoint(trained["opt"]["ckpt"], trained["opt"]["ckpt"] / "step_00000002" / "hf")


def test_export_config_composes_and_checks():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        dcfg = compose("export", overrides=["checkpoint_path=/c", "out=/o", "max_shard_size=2GiB", "output_dir=/x"])
    cfg = ExportConfig.from_dict(OmegaConf.to_container(dcfg, resolve=True))
    assert (cfg.checkpoint_path, cfg.out, parse_size(cfg.max_shard_size), cfg.dtype) == ("/c", "/o", 2 * 2**30, None)
    assert ExportConfig.from_dict({"checkpoint_path": "/c", "out": "/o", "max_shard_size": 1000}).max_shard_size == "1000"
    assert parse_size("5GB") == 5 * 10**9 and parse_size("1.5MiB") == 3 * 2**19
    for bad, field in (({"out": "/o"}, "checkpoint"), ({"checkpoint_path": "/c"}, "out"),
                       ({"checkpoint_path": "/c", "out": "/o", "max_shard_size": "5 parsecs"}, "max_shard_size"),
                       ({"checkpoint_path": "/c", "out": "/o", "dtype": "int4"}, "dtype")):
        with pytest.raises(ValueError, match=f"^{field}: "):
            ExportConfig.from_dict(bad)


# --- the command lines -----------------------------------------------------------------------------------------------


def _cli(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=clean_env(cwd), capture_output=True,
                          text=True, timeout=300)


def test_generate_cli_from_a_checkpoint_gives_hugging_face_greedy_tokens(trained, tmp_path):
    run = trained["llama"]
    proc = _cli("fsdp_speedloader.app.generate", f"checkpoint={run['ckpt']}", "logger=none", "device=cpu",
                "max_new_tokens=6", "num_sub_batches=2", "warmup=false", "prompts.num_prompts=4",
                "prompts.prompt_len=8", f"hydra.run.dir={tmp_path / 'gen'}", cwd=tmp_path)  # no model group
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"loaded LlamaForCausalLM from {run['ckpt']}" in proc.stdout + proc.stderr  # the architecture
    records = [json.loads(line) for line in (tmp_path / "gen" / "generations.jsonl").read_text().splitlines()]
    assert len(records) == 4

    hf_dir = export_checkpoint(run["ckpt"], tmp_path / "hf")
    model = _assert_weights(hf_dir, run["state"])
    model.generation_config.eos_token_id = None  # synthetic prompts never stop early
    model.generation_config.pad_token_id = 0
    prompts = torch.tensor([r["prompt_tokens"] for r in records])
    expected = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=6,
                              do_sample=False)[:, prompts.shape[1]:]
    assert [r["completion_tokens"] for r in records] == expected.tolist()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)  # the checkpoint's tokenizer decoded them
    assert [r["completion"] for r in records] == [tokenizer.decode(r["completion_tokens"]) for r in records]


def test_export_cli_writes_and_refuses_in_one_line(trained, tmp_path):
    ckpt = trained["opt"]["ckpt"]
    proc = _cli("fsdp_speedloader.app.export", f"checkpoint={ckpt}", f"out={tmp_path / 'hf'}",
                "max_shard_size=40000", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    _assert_weights(tmp_path / "hf", trained["opt"]["state"])

    proc = _cli("fsdp_speedloader.app.export", f"checkpoint={ckpt}", f"out={tmp_path / 'hf'}", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: out: {tmp_path / 'hf'} is not empty")
    assert "Traceback" not in proc.stderr

    under_a_file = tmp_path / "hf" / "config.json" / "hf"
    proc = _cli("fsdp_speedloader.app.export", f"checkpoint={ckpt}", f"out={under_a_file}", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: out: cannot write to '{under_a_file}': '{tmp_path / 'hf' / 'config.json'}' is a file, not a "
        "directory; set out to a directory you can write to")
    assert not under_a_file.exists()
