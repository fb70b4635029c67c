"""The main job on its built-in default: the tiny K3 model, TP=2 on CPU (gloo), compiled with
the k3 backend, decoding a few tokens, with the model's structure, timings and the pass report.

    python -m k3compile.demo [--tp 2] [--tokens 4] [--batch 2] [--inductor]
"""
from __future__ import annotations

import argparse
import time


def _rank(rank, world, n_tokens, batch, inductor):
    import torch

    import k3compile
    from k3compile.model import K3Config, K3Model, TPInfo

    cfg = K3Config.tiny(dtype="bfloat16")
    model = K3Model(cfg, TPInfo.current())
    be = k3compile.backend(mode="inductor" if inductor else "eager")
    step = torch.compile(model, backend=be, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab, (batch, 4), generator=g)
    cache, ref_cache = model.new_cache(batch), model.new_cache(batch)
    model.prefill(prompt, cache)
    model.prefill(prompt, ref_cache)
    tok = prompt[:, -1]
    out, times, worst = [], [], 0.0
    for _ in range(n_tokens):
        t = time.perf_counter()
        model._check_ids(tok, cache)
        logits = step(tok[:, None], cache)
        times.append(time.perf_counter() - t)
        ref = model.decode(tok, ref_cache)
        worst = max(worst, ((logits - ref).abs().max() / ref.abs().max()).item())
        tok = logits.argmax(-1)
        out.append(tok.tolist())
    return dict(tokens=out, times=times, err=worst, report=k3compile.last_report().render(),
                structure=dict(layers=cfg.num_layers, kda=cfg.kda_layers, mla=cfg.mla_layers,
                               dense=list(cfg.dense_layers), moe=len(cfg.moe_layers),
                               blocks_written=[i for i in range(cfg.num_layers) if cfg.writes_block(i)]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--inductor", action="store_true", help="Inductor codegen instead of the eager rewrite mode")
    a = ap.parse_args(argv)
    from k3compile.distributed import run_ranks
    from k3compile.model import K3Config
    K3Config.tiny().check_tp(a.tp)
    t = time.perf_counter()
    res = run_ranks(_rank, a.tp, a.tokens, a.batch, a.inductor)
    r0 = res[0]
    s = r0["structure"]
    print(f"tiny K3: {s['layers']} layers (KDA {s['kda']}, MLA {s['mla']}), dense {s['dense']}, "
          f"{s['moe']} LatentMoE layers, AttnRes blocks written at {s['blocks_written']}; TP={a.tp}, batch={a.batch}")
    print(r0["report"])
    print(f"decoded tokens per step (batch of {a.batch}): {r0['tokens']}")
    print(f"step times (s): first (compile) {r0['times'][0]:.2f}, then "
          f"{', '.join(f'{x * 1e3:.0f} ms' for x in r0['times'][1:])}")
    print(f"max relative error vs the uncompiled model: {max(r['err'] for r in res):.2e}; "
          f"ranks agree: {all(r['tokens'] == r0['tokens'] for r in res)}; wall {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
