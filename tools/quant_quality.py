"""Quality of quantized generation, measured on a model trained here: perplexity and greedy-token agreement of
int8 / int4 weights and of an 8-bit KV cache against the same model in bf16.

The model: ``conf/model/llama_tiny`` shapes with a 768-wide MLP (3.5M parameters, byte vocabulary; 688 has no
64-element groups) trained on the embedded corpus
(``fsdp_speedloader/assets``) with AdamW on the CPU, the last 10% of the corpus held out. It is trained once and
saved (Hugging Face directory, ``--model-dir``, default ``outputs/quant_quality/model``); later runs load it
(``--retrain`` trains again).

What is measured (all in bf16 compute, as on the GPU; the fp32 row is the reference of the reference):

- perplexity on held-out windows (teacher forcing, ``--eval-windows`` x ``--eval-len`` bytes) with the weights
  in bf16, int8 (g128) and int4 (g64): the quantized linears are ``fsdp_speedloader.quant.QuantizedLinear``, the
  same formats and dequantization as generation's weight stream;
- perplexity with keys and values round-tripped through the 8-bit codecs (int8, fp8 e4m3, one scale per
  position and head) at EVERY position: each token reads every key and value, its own included, as a cache
  would hand them back (harsher than generation, whose prompt attends to itself in bf16);
- greedy-token agreement with bf16 on a fixed prompt set (``--prompts`` held-out windows of ``--prompt-len``
  bytes, ``--new-tokens`` generated): the fraction of generated positions whose token equals bf16's, and the
  mean length of the common prefix. Generated with ``fsdp_speedloader.generate`` on the prepared model: the
  quantized weights streamed from host memory through ``generation/weight_stream.py``, the 8-bit KV cache in
  the host cache (``kv_cache='host'``), with and without attention on the host (``cpu_attention_sub_batches``).

On this CPU-only machine every kernel is the CPU's (the eager dequantization the GPU runs too: no CUDA-only
kernel exists in these paths). Writes ``bench/results/<name>.json`` and prints a markdown table::

    python tools/quant_quality.py                       # trains (~13 minutes on 2 free cores) or loads, evaluates
    python tools/quant_quality.py --steps 100 --name quant_quality_smoke
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
import harness  # noqa: E402

from fsdp_speedloader import apply_speedloader, generate  # noqa: E402
from fsdp_speedloader.app.data import read_default_corpus  # noqa: E402
from fsdp_speedloader.models import ModelConfig, build_model  # noqa: E402
from fsdp_speedloader.parallel import build_mesh, maybe_init_process_group  # noqa: E402
from fsdp_speedloader.quant import KVCodec, materialize_quantized_weights, quantize_linears_, weight_format  # noqa: E402

REPO = harness.REPO
WEIGHTS = ("bf16", "int8", "int4")
KV_DTYPES = ("int8", "fp8")


# --- data and training --------------------------------------------------------------------------


def corpus_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) byte tokens of the embedded corpus: the last 10% held out."""
    data = torch.frombuffer(bytearray(read_default_corpus().encode("utf-8")), dtype=torch.uint8).long()
    cut = int(0.9 * data.numel())
    return data[:cut], data[cut:]


def model_config(**overrides) -> ModelConfig:
    """llama_tiny's shapes (conf/model/llama_tiny.yaml) but an MLP 768 wide (688 has no 64- or 128-element
    groups), with ``overrides``."""
    base = dict(name="llama_tiny_768", family="llama", hidden_size=256, num_layers=4, num_heads=4,
                intermediate_size=768, vocab_size=320, max_position_embeddings=2048)
    return ModelConfig(**{**base, **overrides})


def train(cfg: ModelConfig, *, steps: int, batch: int, seq_len: int, lr: float, seed: int = 0,
          log_every: int = 50) -> tuple[torch.nn.Module, list[float]]:
    """AdamW (cosine schedule, 5% warm-up) on random windows of the training split, fp32 on the CPU."""
    torch.manual_seed(seed)
    model = build_model(cfg, device="cpu", seed=seed)
    train_tokens, _ = corpus_tokens()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    gen = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for step in range(steps):
        starts = torch.randint(0, train_tokens.numel() - seq_len - 1, (batch,), generator=gen)
        ids = torch.stack([train_tokens[s : s + seq_len] for s in starts.tolist()])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:5d}  loss {loss.item():.3f}", flush=True)
    model.eval()
    return model, losses


# --- the variants -------------------------------------------------------------------------------


def quantized_copy(model: torch.nn.Module, weights: str, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``model`` in ``dtype`` with its block linears in ``weights`` ('bf16': none), dequantized on the
    fly (plain forward)."""
    m = copy.deepcopy(model).to(dtype)
    if weights != "bf16":
        quantize_linears_(m, weight_format(weights))
        materialize_quantized_weights(m, device=torch.device("cpu"), offload=False)
    return m.eval()


class round_trip_kv:
    """Within the block, every attention of ``model`` reads its keys and values round-tripped through ``codec``
    (an attention function registered in Hugging Face's interface, as host_attention.py routes attention)."""

    def __init__(self, model: torch.nn.Module, codec: KVCodec) -> None:
        self.model, self.codec = model, codec

    def __enter__(self):
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        config = self.model.config
        self.original = config._attn_implementation
        inner = ALL_ATTENTION_FUNCTIONS[self.original]
        codec = self.codec

        def attention(module, query, key, value, *args, **kwargs):
            return inner(module, query, codec.round_trip(key), codec.round_trip(value), *args, **kwargs)

        name = f"kv_round_trip_{codec.name}+{self.original}"
        ALL_ATTENTION_FUNCTIONS.register(name, attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[self.original])
        config._attn_implementation = name
        return self

    def __exit__(self, *exc):
        self.model.config._attn_implementation = self.original


@torch.no_grad()
def perplexity(model: torch.nn.Module, windows: torch.Tensor, batch: int = 16) -> float:
    """exp(mean next-token loss) over ``windows`` (W, L): every position but the first predicted."""
    total, count = 0.0, 0
    for k in range(0, windows.shape[0], batch):
        ids = windows[k : k + batch]
        logits = model(input_ids=ids).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="sum")
        total += nll.item()
        count += ids[:, 1:].numel()
    return math.exp(total / count)


def greedy(model: torch.nn.Module, weights: str, prompts: torch.Tensor, new_tokens: int, *,
           dtype: torch.dtype = torch.bfloat16, num_sub_batches: int = 2, offload: bool = True,
           kv_cache: str = "device", kv_cache_dtype=None, cpu_attention: int = 0) -> torch.Tensor:
    """Greedy tokens of ``fsdp_speedloader.generate`` on a copy of the fp32 ``model`` in ``dtype``, its block
    linears in ``weights`` (quantized exactly as ``quantized_copy`` does, then streamed from host memory when
    ``offload``), prepared with ``apply_speedloader`` on one CPU rank."""
    m = copy.deepcopy(model).to(dtype)
    if weights != "bf16":
        quantize_linears_(m, weight_format(weights))
    maybe_init_process_group("cpu")
    apply_speedloader(m, mesh=build_mesh("cpu"), num_sub_batches=num_sub_batches, offload_params=offload)
    if weights != "bf16":
        materialize_quantized_weights(m, device=torch.device("cpu"), offload=offload)
    out = generate(m, prompts, max_new_tokens=new_tokens, num_sub_batches=num_sub_batches, kv_cache=kv_cache,
                   kv_cache_dtype=kv_cache_dtype, cpu_attention_sub_batches=cpu_attention)
    return out[:, prompts.shape[1]:]


def agreement(tokens: torch.Tensor, reference: torch.Tensor) -> dict:
    """Positions equal to the reference's, and the mean common prefix, of greedy outputs (B, T)."""
    equal = tokens == reference
    prefix = torch.where(equal.all(1), torch.full((equal.shape[0],), equal.shape[1]), (~equal).float().argmax(1))
    return {"token_agreement": equal.float().mean().item(), "mean_common_prefix": prefix.float().mean().item(),
            "sequences_identical": int(equal.all(1).sum())}


def held_out_windows(count: int, length: int, seed: int) -> torch.Tensor:
    _, held = corpus_tokens()
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, held.numel() - length - 1, (count,), generator=gen)
    return torch.stack([held[s : s + length] for s in starts.tolist()])


def evaluate(model: torch.nn.Module, args) -> dict:
    """Every row of the table, for a trained fp32 ``model``."""
    dtype = torch.bfloat16
    windows = held_out_windows(args.eval_windows, args.eval_len, seed=1)
    prompts = held_out_windows(args.prompts, args.prompt_len, seed=2)
    rows = []
    fp32 = perplexity(model, windows)
    rows.append({"weights": "fp32", "kv": "fp32", "perplexity": fp32})
    variants = {w: quantized_copy(model, w, dtype) for w in WEIGHTS}
    base_ppl = perplexity(variants["bf16"], windows)
    reference = greedy(model, "bf16", prompts, args.new_tokens)
    for w in WEIGHTS:
        t0 = time.perf_counter()
        ppl = base_ppl if w == "bf16" else perplexity(variants[w], windows)
        tokens = reference if w == "bf16" else greedy(model, w, prompts, args.new_tokens)
        rows.append({"weights": w, "kv": "bf16", "perplexity": ppl, "perplexity_vs_bf16": ppl / base_ppl - 1,
                     "greedy_path": "weights streamed from the host (WeightStream), KV on the device",
                     **agreement(tokens, reference), "seconds": time.perf_counter() - t0})
    for kv in KV_DTYPES:
        t0 = time.perf_counter()
        with round_trip_kv(variants["bf16"], KVCodec(kv)):
            ppl = perplexity(variants["bf16"], windows)
        copied = greedy(model, "bf16", prompts, args.new_tokens, kv_cache="host", kv_cache_dtype=kv)
        on_host = greedy(model, "bf16", prompts, args.new_tokens, kv_cache="host", kv_cache_dtype=kv, cpu_attention=1)
        rows.append({"weights": "bf16", "kv": kv, "perplexity": ppl, "perplexity_vs_bf16": ppl / base_ppl - 1,
                     "greedy_path": "kv_cache='host' 8-bit, copied to the device and dequantized",
                     **agreement(copied, reference),
                     "cpu_attention": {"greedy_path": "kv_cache='host' 8-bit, sub-batch 0 attending on the host",
                                       **agreement(on_host, reference),
                                       "tokens_equal_copied_path": bool(torch.equal(on_host, copied))},
                     "seconds": time.perf_counter() - t0})
    int4_kv = quantized_copy(model, "int4", dtype)
    with round_trip_kv(int4_kv, KVCodec("int8")):
        ppl = perplexity(int4_kv, windows)
    tokens = greedy(model, "int4", prompts, args.new_tokens, kv_cache="host", kv_cache_dtype="int8")
    rows.append({"weights": "int4", "kv": "int8", "perplexity": ppl, "perplexity_vs_bf16": ppl / base_ppl - 1,
                 "greedy_path": "weights streamed, kv_cache='host' 8-bit", **agreement(tokens, reference)})
    return {"perplexity_bf16": base_ppl, "perplexity_fp32": fp32, "rows": rows,
            "eval": {"windows": args.eval_windows, "window_len": args.eval_len, "tokens": args.eval_windows * (args.eval_len - 1),
                     "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                     "formats": {"int8": dataclasses.asdict(weight_format("int8")),
                                 "int4": dataclasses.asdict(weight_format("int4"))}}}


def load_or_train(args) -> tuple[torch.nn.Module, dict]:
    from transformers import AutoModelForCausalLM

    out = Path(args.model_dir)
    if out.is_dir() and not args.retrain:
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        info = __import__("json").loads((out / "training.json").read_text())
        return model, {**info, "loaded_from": str(out)}
    cfg = model_config()
    t0 = time.perf_counter()
    model, losses = train(cfg, steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr)
    info = {"model": dataclasses.asdict(cfg), "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len,
            "lr": args.lr, "train_s": time.perf_counter() - t0, "first_loss": losses[0],
            "final_loss_mean_last_20": sum(losses[-20:]) / len(losses[-20:]),
            "held_out_loss_fp32": math.log(perplexity(model, held_out_windows(32, args.eval_len, seed=1)))}
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    (out / "training.json").write_text(__import__("json").dumps(info, indent=2))
    return model, info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(REPO / "outputs" / "quant_quality" / "model"))
    parser.add_argument("--retrain", action="store_true")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument("--eval-len", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--name", default="quant_quality_llama_tiny")
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    header = harness.record_header("quant_quality", __file__, device=harness.cpu_name())
    model, training = load_or_train(args)
    t0 = time.perf_counter()
    figures = evaluate(model, args)
    record = {**header, "config": vars(args), "training": training, **figures, "eval_s": time.perf_counter() - t0,
              "kernels": "CPU: eager dequantization (formats.dequantize, kv.dequantize_kv) and the CPU's bf16 matmul "
                         "and SDPA; the same code the GPU runs, no CUDA-only kernel in these paths"}
    path = harness.write_record(Path(args.out_dir) / f"{args.name}.json", record)
    print(f"\n{path}: held-out perplexity bf16 {figures['perplexity_bf16']:.3f} (fp32 {figures['perplexity_fp32']:.3f})\n")
    print("| weights | KV cache | perplexity | vs bf16 | greedy tokens equal to bf16 | mean common prefix |")
    print("|---|---|---|---|---|---|")
    for r in figures["rows"]:
        if r["weights"] == "fp32":
            continue
        agree = f"{r['token_agreement']:.1%}" if "token_agreement" in r else ""
        prefix = f"{r['mean_common_prefix']:.1f}" if "mean_common_prefix" in r else ""
        print(f"| {r['weights']} | {r['kv']} | {r['perplexity']:.3f} | {r.get('perplexity_vs_bf16', 0):+.2%} | {agree} "
              f"| {prefix} |")


if __name__ == "__main__":
    main()
