"""Tables (Markdown) and plots (PNG) from the per-layer benchmark's JSON results.

    python bench/report.py bench/results/layer_*.json --png-dir bench/results/plots > table.md

Per result file (one layer kind x shape set): a Markdown table of eager / Inductor / k3 per M with
k3's speed-up over the faster baseline, the floor and k3's distance from it, kernels per step and
peak memory; a table of the --env variants (k3 under other environment variables) beside k3; an
ablation table where the file has ablation variants; and two PNGs: latency vs M
per mode (log-log), and the per-pass ablation at each ablated M (needs matplotlib: `pip install
matplotlib`; tables are written without it).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

MODES = ("eager", "inductor", "k3")
# variants beside the main table (layer_bench.py's docstring); the baseline is the best of eager,
# Inductor and (where measured) Inductor with PDL
EXTRA = {"inductor_pdl": "Inductor with its PDL", "k3_pdl": "k3 with Inductor's PDL",
         "k3_gemv": "k3 with the Triton GEMV where the sweep found it faster"}


def _all(us: dict) -> float:
    """Every pass with prefetch: `k3all` (results since the gate table was filled); before it, `k3`
    was that configuration."""
    return us.get("k3all", us["k3"])


def _name(d: dict) -> str:
    r = d["rows"][0]
    return f"{r['layer']}_{r['shapes']}_w{r['world']}"


def _ablated(us: dict) -> list[str]:
    """Passes (and `prefetch`) with a `k3-` row, in a stable order."""
    return sorted(k[3:] for k in us if k.startswith("k3-"))


def _tie(r: dict) -> str:
    """eager's own error on inputs moved by one bf16 ulp (the layer's sensitivity; layer_bench), and
    where eager's router had near-tied rows (layer_bench.ROUTE_TIE), k3's error over the other rows."""
    out = f" (eager, inputs +-1 ulp: {r['err_vs_eager']['eager_ulp']:.3g})" if "eager_ulp" in r["err_vs_eager"] else ""
    if r.get("near_tie_rows"):
        out += f" ({r['err_vs_eager_clear_rows']['k3']:.3g} without the {r['near_tie_rows']} near-tie rows)"
    return out


def env_specs(command: str | None) -> dict:
    """{NAME: "K=V,..."} of the --env variants on a layer_bench command line."""
    words = (command or "").split()
    return dict(w.split(":", 1) for a, w in zip(words, words[1:]) if a == "--env" and ":" in w)


def _env_table(d: dict) -> list[str]:
    """The --env variants (k3 compiled and run under those variables) beside k3, same run: us, with the
    launch hidden where timed so, the difference to k3, kernels and error against eager."""
    specs = env_specs(d.get("command"))
    names = [n for n in specs if any(n in r["us"] for r in d["rows"])]
    if not names:
        return []
    out = ["", "k3 under other environment variables, same run (" + "; ".join(f"`{n}`: `{specs[n]}`" for n in names)
           + "); us (launch hidden), the difference to k3 (negative = faster), kernels, error vs eager:", "",
           "| M | k3 us (hidden) | " + " | ".join(f"{n} us (hidden) | {n} - k3 | {n} kernels / err" for n in names) + " |",
           "|---|---|" + "---|---|---|" * len(names)]
    for r in d["rows"]:
        us, hid = r["us"], r.get("us_hidden_launch", {})
        h = lambda n: f" ({hid[n]:.1f})" if n in hid else ""  # noqa: E731
        cells = []
        for n in names:
            if n not in us:
                cells.append(" | | ")
                continue
            diff = f"{us[n] - us['k3']:+.1f}" + (f" ({hid[n] - hid['k3']:+.1f})" if n in hid and "k3" in hid else "")
            err = r.get("err_vs_eager", {}).get(n)
            cells.append(f"{us[n]:.1f}{h(n)} | {diff} | {r['kernels'].get(n, '-')} / "
                         + (f"{err:.3g}" if err is not None else "-"))
        out.append(f"| {r['M']} | {us['k3']:.1f}{h('k3')} | " + " | ".join(cells) + " |")
    return out


def table(d: dict) -> str:
    r0 = d["rows"][0]
    out = [f"**{r0['layer'].upper()} layer {r0['layer_id']}, {r0['shapes']} per-rank shapes on {r0['world']} GPUs** "
           f"(AttnRes blocks {r0['blocks']}, MLA context {r0['ctx']}; commit {d.get('commit')}, {d.get('date')}, "
           f"{d.get('gpu')}; `{d.get('command')}`)", "",
           "| M | eager us | Inductor us | k3 us | k3 vs best baseline | all passes us | floor us | k3 / floor "
           "| kernels e/i/k3 | peak MiB e/i/k3 | k3 err vs eager |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        us, kn, pk = r["us"], r["kernels"], r["peak_bytes"]
        allp = f"{us['k3all']:.1f}" if "k3all" in us else "(= k3)"
        out.append(f"| {r['M']} | {us['eager']:.1f} | {us['inductor']:.1f} | {us['k3']:.1f} | "
                   f"{r['speedup_vs_baseline']:.2f}x | {allp} | {r['floor_us']:.1f} | {r['k3_vs_floor']:.2f}x | "
                   f"{kn['eager']}/{kn['inductor']}/{kn['k3']} | "
                   + "/".join(f"{pk[m] / 2**20:.0f}" for m in MODES) + f" | {r['err_vs_eager']['k3']:.3g}{_tie(r)} |")
    hidden = [r for r in d["rows"] if "us_hidden_launch" in r]
    if hidden:
        out += ["", "The same graphs with the replay's host launch hidden behind a GPU spin before the start "
                "event (`us_hidden_launch`: the per-call cost inside a model-wide graph, where one launch serves "
                "every layer), and the profiler's first-kernel-start to last-kernel-end per call of ten graphed "
                "calls (`span_us`):", "",
                "| M | eager us | Inductor us | k3 us | k3 vs best baseline | k3 / floor | span e/i/k3 us |",
                "|---|---|---|---|---|---|---|"]
        for r in hidden:
            h, sp = r["us_hidden_launch"], r.get("span_us", {})
            spans = "/".join(f"{sp[m]['per_call']:.1f}" if "per_call" in sp.get(m, {}) else "-" for m in MODES)
            out.append(f"| {r['M']} | {h['eager']:.1f} | {h['inductor']:.1f} | {h['k3']:.1f} | "
                       f"{min(h['eager'], h['inductor']) / h['k3']:.2f}x | {h['k3'] / r['floor_us']:.2f}x | {spans} |")
    extra = [v for v in EXTRA if any(v in r["us"] for r in d["rows"])]
    if extra:
        out += ["", "Extra variants, same run (" + "; ".join(f"`{v}`: {EXTRA[v]}" for v in extra) + "):", "",
                "| M | best baseline us | k3 us | " + " | ".join(f"{v} us | {v} vs baseline" for v in extra) + " |",
                "|---|---|---|" + "---|---|" * len(extra)]
        for r in d["rows"]:
            us = r["us"]
            best = min(us["eager"], us["inductor"], us.get("inductor_pdl", float("inf")))
            cells = " | ".join(f"{us[v]:.1f} | {best / us[v]:.2f}x" if v in us else " | " for v in extra)
            out.append(f"| {r['M']} | {best:.1f} | {us['k3']:.1f} | {cells} |")
    out += _env_table(d)
    abl = [r for r in d["rows"] if any(k.startswith("k3-") for k in r["us"])]
    base_name = d.get("ablation_base")
    if abl:
        base_txt = ("every pass, no L2 prefetch (`k3-prefetch`); the `prefetch` row compares `k3all` (with it) "
                    "with that" if base_name else "every pass with the L2 prefetch (`k3all`)")
        out += ["", "Ablation (us per layer step, profitability gate off; `alone`: that pass only, `without`: "
                "every pass but that one (`prefetch`: every pass, no L2 prefetch); `all - without` against "
                f"{base_txt}; the effects are differences, negative = faster):", "",
                "| M | pass | alone | alone - no pass | without | all - without |",
                "|---|---|---|---|---|---|"]
        for r in abl:
            us = r["us"]
            none = us.get("k3none")
            if none is not None:
                out.append(f"| {r['M']} | (no pass: `k3none`) | {none:.1f} | 0 | | |")
            for p in _ablated(us):
                alone = us.get("k3+" + p)
                cells = (f"{alone:.1f} | {alone - none:+.1f}" if alone is not None and none is not None
                         else (f"{alone:.1f} | " if alone is not None else " | "))
                base = _all(us) if p == "prefetch" or not base_name else us[base_name]
                out.append(f"| {r['M']} | {p} | {cells} | {us['k3-' + p]:.1f} | {base - us['k3-' + p]:+.1f} |")
    return "\n".join(out)


def plots(d: dict, png_dir: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    png_dir.mkdir(parents=True, exist_ok=True)
    name, rows, made = _name(d), d["rows"], []
    fig, ax = plt.subplots(figsize=(6, 4))
    ms = [r["M"] for r in rows]
    for m in MODES:
        ax.plot(ms, [r["us"][m] for r in rows], marker="o", label=m)
    ax.plot(ms, [r["floor_us"] for r in rows], ls="--", color="grey", label="floor (bytes / HBM BW)")
    ax.set(xscale="log", yscale="log", xlabel="M (tokens per step)", ylabel="us per layer step",
           title=f"{name}: latency vs M (CUDA graphs)")
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.legend()
    fig.tight_layout()
    made.append(png_dir / f"{name}_latency.png")
    fig.savefig(made[-1], dpi=110)
    plt.close(fig)
    abl = [r for r in rows if any(k.startswith("k3-") for k in r["us"])]
    if abl:
        fig, axes = plt.subplots(1, len(abl), figsize=(6 * len(abl), 4), squeeze=False)
        for ax, r in zip(axes[0], abl):
            us = r["us"]
            ps = _ablated(us)
            x = range(len(ps))
            ax.bar([i - 0.2 for i in x], [us["k3-" + p] for p in ps], 0.4, label="all passes but this one")
            ax.bar([i + 0.2 for i in x], [us.get("k3+" + p, float("nan")) for p in ps], 0.4, label="this pass alone")
            if d.get("ablation_base"):
                ax.axhline(us[d["ablation_base"]], color="k", ls="--", label="all passes, no prefetch (the base)")
            else:
                ax.axhline(_all(us), color="k", ls="--", label="all passes")
            if "k3none" in us:
                ax.axhline(us["k3none"], color="g", ls="-.", label="no pass (k3none)")
            ax.axhline(min(us["eager"], us["inductor"]), color="r", ls=":", label="best baseline")
            ax.set_xticks(list(x), [p.replace("_", "\n") for p in ps], fontsize=7)
            ax.set(ylabel="us per layer step", title=f"{name} M={r['M']}: per-pass ablation")
            ax.legend(fontsize=7)
        fig.tight_layout()
        made.append(png_dir / f"{name}_ablation.png")
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    return made


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--png-dir", type=Path, default=None)
    a = ap.parse_args()
    for f in a.files:
        d = json.loads(f.read_text())
        print(table(d) + "\n")
        if a.png_dir is not None:
            try:
                for p in plots(d, a.png_dir):
                    print(f"![{p.stem}]({p.as_posix()})\n")
            except ImportError:
                print("(no plots: matplotlib is not installed)\n")


if __name__ == "__main__":
    main()
