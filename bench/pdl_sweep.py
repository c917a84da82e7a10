"""Programmatic dependent launch and the fused kernels' tiles, measured on whole decode steps (GPU only).

    python bench/pdl_sweep.py [--out DIR] [--reps 5]

Per-kernel timings mean little once kernels overlap (kernels/pdl.py), so every setting is measured the way
generation runs: the GPT-2 124M shape in bf16, prompt 128 random tokens, 256 new tokens, greedy, batch 1 and 16,
`model.sampling.generate` with the fused step in a CUDA graph (generate()'s default on a GPU). Per setting and
batch: decode tokens/s of the whole loop (median of --reps after a warm-up) and the GPU time of one bare graph
replay at cache length 256. Settings:

    no-pdl          FLASHGPT_PDL=0: plain launches, pick_config's non-PDL tiles (the previous default)
    pdl-no-preload  PDL launches with the non-PDL tiles: overlap of launch and start-up only
    pdl ...         PDL with each program's weights loaded as one tile before its wait (kernels.ln_linear
                    .PDL_TILES variants: block_n / warps of the K <= 1024 launches, split_block_k / split_block_n
                    of the split-K down projection)

Writes pdl_sweep.json and pdl_sweep.md to --out (default bench/results/).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import kernels.ln_linear as ln_linear  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.sampling import SamplingParams, generate  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_generate", ROOT / "bench" / "generate.py")
bench_generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_generate)  # for graph_replay_us: one bare replay of the captured decode step

DEFAULT_TILES = dict(ln_linear.PDL_TILES)
# (block_n, warps, split_block_k, split_block_n, split_warps): "pdl bnX wY splitKxN wZ" = one-tile launches of X
# columns (at every batch size) with Y warps, the split-K down projection in shares of K x N with Z warps.
TILE_SETTINGS = [
    (16, 4, 512, 32, 4), (16, 8, 512, 32, 8), (32, 4, 512, 32, 4), (32, 8, 512, 32, 8),  # round 1
    (16, 4, 256, 32, 4), (16, 4, 512, 16, 4), (16, 4, 1024, 32, 4),
    (32, 8, 512, 16, 8), (32, 8, 512, 32, 4), (32, 8, 512, 64, 8), (32, 8, 1024, 32, 8),  # round 2, around
    (32, 16, 512, 32, 8), (64, 8, 512, 32, 8), (64, 16, 512, 32, 8),                      # round 1's best
    (32, 8, 512, 128, 8), (32, 8, 256, 64, 8), (32, 8, 256, 128, 8), (32, 8, 512, 64, 4),  # round 3: wider
    (64, 8, 512, 64, 8), (32, 8, 1024, 64, 8),                                             # split tiles
]
SETTINGS = {  # name → (FLASHGPT_PDL, PDL_TILES changes)
    "no-pdl": ("0", {}),
    "pdl default": ("1", {}),  # kernels.ln_linear.PDL_TILES as committed
    "pdl-no-preload": ("1", dict(preload=False)),
    **{f"pdl bn{bn} w{w} split{sk}x{sn} w{sw}": ("1", dict(block_n_few_rows=bn, block_n=bn, warps=w, split_block_k=sk,
                                                          split_block_n=sn, split_warps=sw))
       for bn, w, sk, sn, sw in TILE_SETTINGS},
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--settings", default=None, help="comma-separated subset of the setting names")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("error: bench/pdl_sweep.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304))
    model = model.to(torch.bfloat16).eval()
    model.set_attention_backend("flash")
    params = SamplingParams(temperature=0.0, max_new_tokens=256)
    rows, reference = [], {}
    names = args.settings.split(",") if args.settings else list(SETTINGS)
    for name in names:
        env, tiles = SETTINGS[name]
        os.environ["FLASHGPT_PDL"] = env
        ln_linear.PDL_TILES.clear()
        ln_linear.PDL_TILES.update(DEFAULT_TILES, **tiles)
        for B in (1, 16):
            prompts = torch.randint(0, 50304, (B, 128), generator=torch.Generator().manual_seed(B)).tolist()
            try:
                generate(model, prompts, params, cuda_graph=True)  # warm-up: compilation, capture
                runs = [generate(model, prompts, params, cuda_graph=True) for _ in range(args.reps)]
                tok_s = statistics.median(r.decode_tokens_per_s for r in runs)
                same = reference.setdefault(B, runs[-1].sequences) == runs[-1].sequences
                replay = bench_generate.graph_replay_us(model, B, max_len=384, pos=255, compile_step=False, fused=True)
                row = dict(setting=name, batch=B, decode_tok_s=round(tok_s), replay_us=round(replay, 1),
                           tokens_equal_first_setting=same)
            except Exception as e:  # record and go on
                row = dict(setting=name, batch=B, error=f"{type(e).__name__}: {e}"[:300])
            print(json.dumps(row), flush=True)
            rows.append(row)
    os.environ.pop("FLASHGPT_PDL", None)
    ln_linear.PDL_TILES.clear()
    ln_linear.PDL_TILES.update(DEFAULT_TILES)
    meta = dict(command="python bench/pdl_sweep.py " + " ".join(sys.argv[1:]), device=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=__import__("triton").__version__,
                date=datetime.datetime.now().isoformat(timespec="seconds"), default_tiles=DEFAULT_TILES)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pdl_sweep.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    lines = ["# Programmatic dependent launch and tiles, whole decode steps (GPT-2 124M shape, bf16)", "",
             f"`{meta['command']}`", "",
             f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}. Prompt 128, 256 new "
             f"tokens, greedy, fused step in a CUDA graph; decode tok/s = median of {args.reps} whole loops; replay "
             "= one bare graph replay at cache length 256. Tokens equal: the greedy tokens match the first setting's.",
             "", "| setting | batch | decode tok/s | replay µs | tokens equal |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['batch']} | " + (f"failed: {r['error']} | | |" if "error" in r else
                     f"{r['decode_tok_s']:,} | {r['replay_us']} | {r['tokens_equal_first_setting']} |"))
    (out / "pdl_sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
