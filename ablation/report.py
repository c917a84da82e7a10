"""The ablation's outputs: PNG plots, report.md and (optionally) a wandb run with the same tables and images."""
from __future__ import annotations

import os

from training.runfolder import atomic_file, write_text_atomic

from .io_model import fmt_bytes

COLORS = {"naive": "tab:red", "flash": "tab:blue", "sdpa": "tab:green"}
STYLE = {"naive": dict(marker="o", lw=2), "flash": dict(marker="o", lw=2), "sdpa": dict(marker="x", lw=1, ls="--")}
PLOTS = {"time": "sweep_time.png", "memory": "sweep_memory.png", "bytes": "sweep_bytes_time.png",
         "loss": "train_loss.png", "probe": "probe_memory.png"}


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _ok(rows, backend):
    return [r for r in rows if r["backend"] == backend and r["status"] == "ok"]


def sweep_memory(r: dict) -> int | None:
    """The memory figure of a row: measured fwd+bwd peak on CUDA, else the analytical activation memory."""
    return r.get("mem_fwdbwd", r.get("mem_analytical"))


def plot_sweep(sweep: dict, out: str) -> list[str]:
    plt = _plt()
    rows, made = sweep["rows"], []
    # time vs N
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for b, c in COLORS.items():
        ok = _ok(rows, b)
        if ok:
            ax.plot([r["N"] for r in ok], [r["fwd_ms"] for r in ok], "o-", color=c, label=f"{b} fwd")
            ax.plot([r["N"] for r in ok], [r["fwdbwd_ms"] for r in ok], "s--", color=c, label=f"{b} fwd+bwd")
    for b, n in sweep["oom"].items():
        ax.axvline(n, color=COLORS.get(b, "k"), ls=":", lw=1)
        ax.text(n, ax.get_ylim()[1], f" {b} OOM", color=COLORS.get(b, "k"), va="top", fontsize=8)
    _finish(ax, "sequence length N", "time (ms)", "attention time vs N", log=True)
    made.append(_save(fig, plt, out, PLOTS["time"]))
    # memory vs N with N² and N reference slopes
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for b, c in COLORS.items():
        ok = [r for r in _ok(rows, b) if sweep_memory(r)]
        if ok:
            ax.plot([r["N"] for r in ok], [sweep_memory(r) / 2**20 for r in ok], color=c, label=b, **STYLE[b])
    for b, power, style in (("naive", 2, "k--"), ("flash", 1, "k:")):
        ok = [r for r in _ok(rows, b) if sweep_memory(r)]
        if ok:
            n0, m0 = ok[0]["N"], sweep_memory(ok[0]) / 2**20
            ns = [r["N"] for r in _ok(rows, "sdpa") or ok]
            ax.plot(ns, [m0 * (n / n0) ** power for n in ns], style, lw=1, label=f"∝ N{'²' if power == 2 else ''}")
    kind = "measured peak, fwd+bwd" if "mem_fwdbwd" in (rows[0] if rows else {}) else "analytical activations"
    _finish(ax, "sequence length N", f"memory (MiB, {kind})", "attention memory vs N", log=True)
    made.append(_save(fig, plt, out, PLOTS["memory"]))
    # bytes vs time
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = []
    for b, c in COLORS.items():
        ok = _ok(rows, b)
        if ok:
            ax.scatter([r["model_fwd_bytes"] for r in ok], [r["fwd_ms"] for r in ok], color=c, marker="o",
                       label=f"{b} fwd")
            ax.scatter([r["model_fwdbwd_bytes"] for r in ok], [r["fwdbwd_ms"] for r in ok], color=c, marker="s",
                       facecolors="none", label=f"{b} fwd+bwd")
            xs += [r["model_fwd_bytes"] for r in ok] + [r["model_fwdbwd_bytes"] for r in ok]
    if xs:
        bw = sweep["copy_bandwidth"]
        lo, hi = min(xs), max(xs)
        ax.plot([lo, hi], [lo / bw * 1e3, hi / bw * 1e3], "k--", lw=1,
                label=f"bytes ÷ copy bandwidth ({bw / 1e9:,.0f} GB/s)")
    _finish(ax, "HBM bytes by the I/O model", "time (ms)", "time follows bytes", log=True)
    made.append(_save(fig, plt, out, PLOTS["bytes"]))
    return made


def plot_training(matched: dict, out: str) -> str:
    plt = _plt()
    runs = matched["runs"]
    base = next(iter(runs))
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7.5, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    for name, run in runs.items():
        c = COLORS.get(name, "k")
        it = sorted(run["step_loss"])
        ax.plot(it, [run["step_loss"][i] for i in it], color=c, lw=0.9, alpha=0.75, label=f"{name} (train step)")
        ev = sorted(run["val"])
        ax.plot(ev, [run["val"][i] for i in ev], "o--", color=c, ms=4, label=f"{name} (val)")
        if name != base:
            common = [i for i in it if i in runs[base]["step_loss"]]
            ax2.plot(common, [abs(run["step_loss"][i] - runs[base]["step_loss"][i]) for i in common], color=c,
                     lw=0.8, label=f"|{name} − {base}|")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("matched training runs (same seed, data order and config)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax2.set_xlabel("step")
    ax2.set_ylabel("|Δ train loss|")
    ax2.grid(alpha=0.3)
    if len(runs) > 1:
        ax2.legend(fontsize=8)
    return _save(fig, plt, out, PLOTS["loss"])


def plot_probe(probe: dict, out: str) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for b, res in probe["backends"].items():
        if res["fits"]:
            ax.plot([f["T"] for f in res["fits"]], [f["peak_gib"] for f in res["fits"]], "o-",
                    color=COLORS.get(b, "k"), label=b)
        if res["oom_at"]:
            ax.axvline(res["oom_at"], color=COLORS.get(b, "k"), ls=":", lw=1)
            ax.text(res["oom_at"], 0, f" {b} OOM", color=COLORS.get(b, "k"), fontsize=8, rotation=90, va="bottom")
    _finish(ax, "context length (block_size)", "peak memory, fwd+bwd (GiB)",
            f"GPT fwd+bwd at batch {probe['batch']}: memory vs context", log=True)
    return _save(fig, plt, out, PLOTS["probe"])


def _finish(ax, xlabel, ylabel, title, log=False):
    if log:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)


def _save(fig, plt, out, name) -> str:
    fig.tight_layout()
    try:
        with atomic_file(os.path.join(out, name), "wb") as f:
            fig.savefig(f, dpi=110, format="png")
    finally:
        plt.close(fig)
    return name


# ------------------------------------------------------------------------------------------------- markdown

def _f(x, fmt="{:.3f}", none="—"):
    return none if x is None else fmt.format(x)


def headline(results: dict) -> list[str]:
    """The few numbers a reader should take away, as markdown bullets."""
    lines = []
    sweep = results.get("sweep")
    if sweep:
        rows = sweep["rows"]
        both = sorted({r["N"] for r in _ok(rows, "naive")} & {r["N"] for r in _ok(rows, "flash")})
        if both:
            N = both[-1]
            nv = next(r for r in _ok(rows, "naive") if r["N"] == N)
            fl = next(r for r in _ok(rows, "flash") if r["N"] == N)
            mem = (f"{sweep_memory(nv) / sweep_memory(fl):,.0f}× less memory than naive ({fmt_bytes(sweep_memory(fl))}"
                   f" vs {fmt_bytes(sweep_memory(nv))})") if sweep_memory(fl) else "memory n/a"
            ratio = nv["model_fwdbwd_bytes"] / fl["model_fwdbwd_bytes"]
            if sweep["settings"]["device"].startswith("cuda"):
                lines.append(f"At N={N}, flash runs forward+backward in {fl['fwdbwd_ms']:.3f} ms vs naive "
                             f"{nv['fwdbwd_ms']:.3f} ms ({nv['fwdbwd_ms'] / fl['fwdbwd_ms']:.1f}× faster), with "
                             f"{mem}; by the I/O model naive moves {ratio:.1f}× the bytes.")
            else:
                lines.append(f"At N={N}, by the I/O model naive moves {ratio:.1f}× the bytes of flash, and flash "
                             f"holds {mem}. (CPU times are not comparable here: flash runs in Triton's interpreter.)")
        if "naive" in sweep["oom"]:
            lines.append(f"Naive attention runs out of memory at N={sweep['oom']['naive']} "
                         f"(B={sweep['settings']['B']}, H={sweep['settings']['H']}, D={sweep['settings']['D']}); "
                         f"flash reaches N={max((r['N'] for r in _ok(rows, 'flash')), default='—')}.")
        else:
            lines.append(f"Naive attention fitted at every N tried (up to {max(sweep['settings']['seq_lens'])}).")
    m = results.get("matched")
    if m and "flash" in m["compare"]:
        c, runs = m["compare"]["flash"], m["runs"]
        base, fl = runs[c["vs"]], runs["flash"]
        extra = ""
        if "sdpa" in m["compare"] and m["compare"]["sdpa"]["max_abs_dloss"] is not None:
            extra = f" (sdpa vs {c['vs']}, the noise reference: {m['compare']['sdpa']['max_abs_dloss']:.2e})"
        if base["tokens_per_s"] and fl["tokens_per_s"]:
            extra += (f"; flash trains at {fl['tokens_per_s']:,.0f} tokens/s vs {c['vs']} {base['tokens_per_s']:,.0f} "
                      f"({fl['tokens_per_s'] / base['tokens_per_s']:.2g}×)")
        if base["peak_mem_gib"] and fl["peak_mem_gib"]:
            extra += f", peak memory {fl['peak_mem_gib']:.2f} vs {base['peak_mem_gib']:.2f} GiB"
        lines.append(f"Matched training: flash and {c['vs']} losses agree to max |Δ| = "
                     f"{_f(c['max_abs_dloss'], '{:.2e}')} per step over {c['steps']} steps{extra}; val gap "
                     f"{_f(c['val_gap'], '{:+.2e}')} at step {c['val_iter']}.")
    p = results.get("probe")
    if p and p.get("backends"):
        parts = []
        for b, res in p["backends"].items():
            top = res["fits"][-1]["T"] if res["fits"] else None
            parts.append(f"{b} fits T={top}" + (f" (OOM at {res['oom_at']})" if res["oom_at"] else
                                                 f" ({res['stopped']})"))
        lines.append(f"Largest context at batch {p['batch']}: " + "; ".join(parts) + ".")
    return [f"- {x}" for x in lines]


def sweep_section(sweep: dict) -> list[str]:
    s = sweep["settings"]
    t = s["tiles"]
    out = ["## 1. Kernel sweep", "",
           f"B={s['B']}, H={s['H']}, D={s['D']}, {s['dtype']}, causal={s['causal']}, device {s['device']}. "
           f"Time: {s['timing']}. Memory: {s['memory']}. Flash tiles (BLOCK_M×BLOCK_N), pinned (no autotuning): "
           f"forward {t['fwd'][0]}×{t['fwd'][1]}, dK/dV {t['dkdv'][0]}×{t['dkdv'][1]}, dQ {t['dq'][0]}×{t['dq'][1]}. "
           "Bytes: the standard I/O model (see the last section); sdpa is modelled as flash with the same tiles. "
           "GB/s = model bytes ÷ time (fwd+bwd); err = relative L2 difference of the output from sdpa's.", "",
           "| N | backend | fwd ms | fwd+bwd ms | memory | model bytes fwd | model bytes fwd+bwd | GB/s | err vs sdpa |",
           "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sweep["rows"]:
        if r["status"] != "ok":
            out.append(f"| {r['N']} | {r['backend']} | {_f(r.get('fwd_ms'))} | {r['status']} | "
                       f"{fmt_bytes(r['mem_analytical']) + ' (analytical)' if r.get('mem_analytical') else ''} | "
                       f"{fmt_bytes(r['model_fwd_bytes']) if 'model_fwd_bytes' in r else ''} | "
                       f"{fmt_bytes(r['model_fwdbwd_bytes']) if 'model_fwdbwd_bytes' in r else ''} | | |")
            continue
        gbs = r["model_fwdbwd_bytes"] / (r["fwdbwd_ms"] * 1e-3) / 1e9
        out.append(f"| {r['N']} | {r['backend']} | {r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | "
                   f"{fmt_bytes(sweep_memory(r))} | {fmt_bytes(r['model_fwd_bytes'])} | "
                   f"{fmt_bytes(r['model_fwdbwd_bytes'])} | {gbs:,.3g} | {_f(r['err_vs_sdpa'], '{:.1e}')} |")
    oom = sweep["oom"]
    out += ["", ("Out of memory: " + ", ".join(f"{b} at N={n}" for b, n in oom.items()) + " (the later rows "
                 "are skipped; memory was freed after each failure).") if oom else
            "No backend ran out of memory in this sweep."]
    if sweep["skipped"]:
        out.append(f"Not measured (time budget spent): N={', '.join(map(str, sweep['skipped']))}.")
    out += ["", f"Measured copy bandwidth (bytes read + written): {sweep['copy_bandwidth'] / 1e9:,.1f} GB/s — the "
            "dashed line in the bytes plot is model bytes ÷ this bandwidth, the least time those bytes can take.",
            "", f"![time vs N]({PLOTS['time']})", f"![memory vs N]({PLOTS['memory']})",
            f"![bytes vs time]({PLOTS['bytes']})", ""]
    if not s["device"].startswith("cuda"):
        out += ["On the CPU, flash runs through Triton's interpreter (numpy, one program at a time): its times "
                "show that the kernel works, not how fast it is. Run on a GPU for the real comparison.", ""]
    return out


def matched_section(m: dict | None, note: str) -> list[str]:
    out = ["## 2. Matched training runs", ""]
    if not m:
        return out + [note, ""]
    out += [note, "",
            "| attention | steps | final val loss | tokens/s (median) | peak memory | max \\|Δloss\\| per step | "
            "mean \\|Δloss\\| | val gap (last common eval) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, run in m["runs"].items():
        c = m["compare"].get(name, {})
        out.append(f"| {name} | {run['iters']} | {_f(run['val_loss'], '{:.4f}')} | "
                   f"{_f(run['tokens_per_s'], '{:,.0f}')} | {_f(run['peak_mem_gib'], '{:.2f} GiB', 'n/a (CPU)')} | "
                   f"{_f(c.get('max_abs_dloss'), '{:.2e}', 'reference')} | {_f(c.get('mean_abs_dloss'), '{:.2e}', '')} | "
                   f"{_f(c.get('val_gap'), '{:+.2e}', '')} |")
    out += ["", f"![matched loss curves]({PLOTS['loss']})", ""]
    return out


def probe_section(p: dict | None, note: str) -> list[str]:
    out = ["## 3. Largest context that fits", ""]
    if not p:
        return out + [note, ""]
    out += [f"One GPT forward+backward (bf16 autocast, batch {p['batch']}, the model of section 2, no optimizer "
            f"state) at block_size = {p['start']}, doubling until out of memory or T={p['max_len']}.", "",
            "| attention | T | peak memory | tokens/s |", "| --- | ---: | ---: | ---: |"]
    for b, res in p["backends"].items():
        for f in res["fits"]:
            out.append(f"| {b} | {f['T']} | {f['peak_gib']:.2f} GiB | {f['tokens_per_s']:,.0f} |")
        out.append(f"| {b} | — | {res['stopped']} | |")
    out += ["", f"![probe]({PLOTS['probe']})", ""]
    return out


IO_MODEL_TEXT = """## The I/O model

Per head of length N and head dim D, in elements of the input dtype (softmax statistics in float32):

- naive forward: read Q, K, V (3·N·D), write S (N²), read S (N²), write P (N²), read P (N²), write O (N·D): **4·N² + 4·N·D**.
- naive backward (from the saved P): dV = PᵀdO, dP = dO Vᵀ, dS = P∘(dP − rowsum(dP∘P)), dQ = dS K, dK = dSᵀQ:
  **7·N² + 8·N·D**. Memory: S and P, **2·N²** per head.
- flash forward, Tr = ⌈N/Br⌉ query tiles of Br rows: read Q once (N·D), K and V once per query tile
  (Tr·2·N·D non-causal; causal: only the visible key tiles, about (Tr+1)/2 of them), write O (N·D) and the
  log-sum-exp (4 bytes per row). Memory: O and the log-sum-exp, **N·D + N** per head.
- flash backward (FA2): delta = rowsum(dO∘O); a dK/dV pass that reads K, V once and streams Q, dO per key tile; a dQ
  pass that reads Q, dO once and streams K, V per query tile; writes dQ, dK, dV.

So naive moves Θ(N²) bytes and keeps Θ(N²) memory; flash moves Θ(N²·D/Br) bytes (the N² term divided by the
tile height) and keeps Θ(N·D). The exact formulas are `ablation/io_model.py`; this repo's naive kernel makes more
passes than the standard model (scale, mask, fp32 casts are separate kernels), so its real traffic is higher.
"""


def write_report(results: dict, out: str) -> str:
    meta = results["meta"]
    lines = ["# flashgpt ablation: naive vs flash attention", "",
             f"{meta['date']} · {meta['device_name']} · torch {meta['torch']} · triton {meta['triton']} · "
             f"mode: {meta['mode']} · {meta['seconds']:.0f} s in all", "", f"Command: `{meta['command']}`", "",
             "## Headline", "", *(headline(results) or ["- (nothing measured)"]), ""]
    if results.get("sweep"):
        lines += sweep_section(results["sweep"])
    else:
        lines += ["## 1. Kernel sweep", "", results.get("sweep_note", "skipped (--skip-sweep)"), ""]
    lines += matched_section(results.get("matched"), results.get("matched_note", ""))
    lines += probe_section(results.get("probe"), results.get("probe_note", ""))
    lines += [IO_MODEL_TEXT, "Data: `results.json` in this folder holds every number above."]
    path = os.path.join(out, "report.md")
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path


def write_readme_section(results: dict, out: str, plot_dir: str = "bench/results/ablation") -> str:
    """readme_section.md: the README's short ablation section with this run's headline figures and one plot,
    linked as plot_dir/… (the folder the run directory is copied to for the README: bench/results/ablation)."""
    meta, sweep = results["meta"], results.get("sweep") or {}
    s = sweep.get("settings", {})
    shape = f"B={s['B']}, H={s['H']}, D={s['D']}, {s['dtype']}, causal" if s else ""
    plot = PLOTS["memory"] if sweep else PLOTS["loss"]
    lines = ["## Why FlashAttention: the ablation", "",
             "`python ablate.py` measures, on your hardware, what the Triton kernel buys over naive attention: a "
             "sweep over sequence lengths (time, peak memory and the HBM bytes of the standard I/O model for naive, "
             "flash and PyTorch's SDPA), matched training runs that differ only in the attention backend, and the "
             "longest context each fits. Naive attention writes the N×N scores S and probabilities P to memory and "
             "reads them back; flash keeps its tiles on chip and writes only the output.", "",
             f"On {meta['device_name']} ({shape}; torch {meta['torch']}, triton {meta['triton']}):", "",
             *headline(results), "",
             f"![{'memory vs sequence length' if sweep else 'matched loss curves'}]({plot_dir}/{plot})", "",
             f"Full report: [{plot_dir}/report.md]({plot_dir}/report.md). Without a GPU, `python ablate.py` runs a "
             "reduced version in about two minutes (flash through Triton's interpreter), so anyone can try it.", ""]
    path = os.path.join(out, "readme_section.md")
    write_text_atomic(path, "\n".join(lines))
    return path


def log_wandb(results: dict, out: str, images: list[str], project: str, run_name: str) -> None:
    import wandb  # lazy: only when asked for
    from training.runlog import wandb_mode
    run = wandb.init(project=project, name=run_name or "ablate", dir=out, mode=wandb_mode(),
                     config={"meta": results["meta"], "sweep": (results.get("sweep") or {}).get("settings")})
    logged = {}
    if results.get("sweep"):
        cols = ["N", "backend", "status", "fwd_ms", "fwdbwd_ms", "memory_bytes", "model_fwd_bytes",
                "model_fwdbwd_bytes"]
        data = [[r["N"], r["backend"], r["status"], r.get("fwd_ms"), r.get("fwdbwd_ms"), sweep_memory(r),
                 r.get("model_fwd_bytes"), r.get("model_fwdbwd_bytes")] for r in results["sweep"]["rows"]]
        logged["sweep"] = wandb.Table(columns=cols, data=data)
    if results.get("matched"):
        m = results["matched"]
        cols = ["attention", "iters", "val_loss", "tokens_per_s", "peak_mem_gib", "max_abs_dloss", "val_gap"]
        data = [[n, r["iters"], r["val_loss"], r["tokens_per_s"], r["peak_mem_gib"],
                 m["compare"].get(n, {}).get("max_abs_dloss"), m["compare"].get(n, {}).get("val_gap")]
                for n, r in m["runs"].items()]
        logged["training"] = wandb.Table(columns=cols, data=data)
    for name in images:
        logged[os.path.splitext(name)[0]] = wandb.Image(os.path.join(out, name))
    run.log(logged)
    run.finish()
