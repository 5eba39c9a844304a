"""Per-decoding-step host overhead of layer-major generation, on the CPU (compute negligible).

A tiny model (hidden 64, one thread) makes every kernel cost microseconds, so a decoding step's time is
what the host spends per (unit, group of sequences): the decoder-layer calls, FSDP2's per-unit hooks,
KV-cache handling, masks and positions. Prints ms per decoding step (best of ``--repeats`` generations)
for LLaMA and OPT at N in {1, 2, 4}; ``--profile`` adds cProfile's top entries (cumulative time) of one
generation; ``--out FILE`` writes a JSON record (device, torch version, commit, command line, figures).

    python tools/profile_decode.py                                   # the README's figures
    python tools/profile_decode.py --kv-cache host --family opt
    python tools/profile_decode.py --family opt --num-sub-batches 2 --profile
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package: its modules import by name
import harness  # noqa: E402

sys.path.insert(0, str(harness.REPO))

from fsdp_speedloader import apply_speedloader  # noqa: E402
from fsdp_speedloader.app.config import ModelConfig  # noqa: E402
from fsdp_speedloader.generation.generate import generate  # noqa: E402
from fsdp_speedloader.models import build_model  # noqa: E402
from fsdp_speedloader.parallel import build_mesh, maybe_init_process_group  # noqa: E402


def _decode_ms(model, ids, mask, args, num_sub_batches: int) -> float:
    kwargs = dict(max_new_tokens=args.gen_len, num_sub_batches=num_sub_batches, kv_cache=args.kv_cache,
                  return_stats=True)
    generate(model, ids, mask, **kwargs)  # warm-up: lazy init, activation slots
    best = float("inf")
    for _ in range(args.repeats):
        _, stats = generate(model, ids, mask, **kwargs)
        best = min(best, stats.decode_s / max(stats.num_steps - 1, 1))
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=("llama", "opt"), action="append", help="repeatable; default both")
    p.add_argument("--num-sub-batches", type=int, action="append", help="repeatable; default 1, 2, 4")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--kv-cache", default="device", choices=("device", "host", "off"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="cProfile one generation and print the top entries")
    p.add_argument("--out", default=None, help="write a JSON record here")
    args = p.parse_args()
    torch.set_num_threads(1)
    maybe_init_process_group("cpu")
    rows = []
    for family in args.family or ["llama", "opt"]:
        cfg = ModelConfig(family=family, hidden_size=64, num_layers=args.layers, num_heads=4,
                          num_kv_heads=2 if family == "llama" else None, intermediate_size=128, vocab_size=128,
                          max_position_embeddings=args.prompt_len + args.gen_len)
        base = build_model(cfg, device="cpu", seed=0)
        ids = torch.randint(3, 128, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        mask[1:, :3] = 0  # left padding: the masked path, as in a real batch of prompts
        for num_sub in args.num_sub_batches or [1, 2, 4]:
            model = apply_speedloader(copy.deepcopy(base), mesh=build_mesh("cpu"), num_sub_batches=num_sub)
            ms = _decode_ms(model, ids, mask, args, num_sub)
            rows.append(dict(family=family, num_sub_batches=num_sub, ms_per_decode_step=ms))
            print(f"{family:5s} N={num_sub} layers={args.layers}: {ms:7.2f} ms per decoding step", flush=True)
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                generate(model, ids, mask, max_new_tokens=args.gen_len, num_sub_batches=num_sub,
                         kv_cache=args.kv_cache)
                prof.disable()
                pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
    if args.out:
        header = harness.record_header("profile_decode", __file__, device=f"{harness.cpu_name()}, 1 thread")
        harness.write_record(args.out, {**header, "config": vars(args), "results": rows})


if __name__ == "__main__":
    main()
