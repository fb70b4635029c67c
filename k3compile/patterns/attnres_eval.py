"""The AttnRes mixer's region evaluated on random values (patterns/attnres.py's check of a found mixer):
its replay in the model's dtypes or in fp32, the order of its weights, and the rounding order of its
logits and weighted sum (k3compile/rounding.py's MIX_* bits), found by replaying the candidates."""
from __future__ import annotations

import operator  # noqa: F401
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily  # noqa: F401
from torch.fx import Node  # noqa: F401
from torch.fx.node import map_aggregate  # noqa: F401

from ..ops import reference as ref
from .graph import CONVERT_OPS, Fail, aten, concrete, describe, is_call, match_rms_norm, shape, strip_converts, val  # noqa: F401

_LOW_PRECISION = {torch.bfloat16, torch.float16}


def _sig(n: Any) -> tuple | None:
    """A node's shape as strings (symbolic sizes by name): compared without guarding on SymInts."""
    s = shape(n)
    return None if s is None else tuple(str(d) for d in s)


def _order_weights(f: _Found) -> tuple:
    """(w_norm, w_qk): the weight a key RMSNorm multiplies by is w_norm (their product is what the
    math uses; the order only names them)."""
    a, b = f.weights
    inside = set(f.region)
    for w in (a, b):
        users = [u for u in w.users if u in inside]
        while users:
            u = users.pop()
            if is_call(u) and u.target in CONVERT_OPS:
                users.extend(x for x in u.users if x in inside)
                continue
            site = match_rms_norm(u)
            if not isinstance(site, Fail) and site.weight is not None and strip_converts(site.weight) is w:
                return (w, b if w is a else a)
    return a, b


def _replay(f: _Found, fp32: bool, seed: int = 1234) -> tuple | Fail:
    """f's region run once on random CPU tensors, all floats as fp32 (casts to bf16 / fp16 become
    fp32: the math alone) or as the graph's dtypes (meta['val']): (output, {source: its tensor},
    the weights' tensors in f.weights' order, the lowest float dtype seen, {region node: its value})."""
    dims = [concrete(d) for d in shape(f.mixed)]
    if None in dims:
        return Fail(f.mixed, f"the AttnRes mixer's shape {shape(f.mixed)} has a size without an example value")

    def dt(n):
        d = val(n).dtype if isinstance(val(n), torch.Tensor) else torch.float32
        return torch.float32 if fp32 and d in _LOW_PRECISION else d

    def fix(a):
        if isinstance(a, Node):
            return env[a]
        if isinstance(a, torch.device):
            return torch.device("cpu")
        if fp32 and isinstance(a, torch.dtype) and a in _LOW_PRECISION:
            return torch.float32
        return a

    lowest = torch.float32
    with unset_fake_temporarily(), torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        h = dims[-1]
        base = {s: (torch.randn(dims, generator=g, dtype=torch.float64) * (0.5 + 0.35 * i) + 0.1 * i).to(dt(s))
                for i, s in enumerate(f.sources)}
        w = [(1 + 0.25 * torch.randn(h, generator=g, dtype=torch.float64)),
             torch.randn(h, generator=g, dtype=torch.float64) * (2.0 / h ** 0.5)]
        w = [x.to(dt(n)) for x, n in zip(w, f.weights)]
        env: dict = {}
        for n, (kind, v) in f.leaves.items():
            if kind == "src" or kind == "alias":
                env[n] = base[v].to(dt(n))
            elif kind == "stack":
                env[n] = torch.stack([base[x] for x in v]).to(dt(n))
            elif kind == "weight":
                env[n] = w[f.weights.index(n)]
            elif kind == "const":
                env[n] = v.detach().to("cpu", torch.float32 if fp32 and v.dtype in _LOW_PRECISION else v.dtype)
            else:
                env[n] = v
        for d in (dt(s) for s in [*f.sources, *f.weights]):
            lowest = d if d in _LOW_PRECISION else lowest
        try:
            for n in f.region:
                args = map_aggregate(n.args, fix)
                kwargs = map_aggregate(n.kwargs, fix)
                env[n] = n.target(*args, **kwargs)
                if isinstance(env[n], torch.Tensor) and env[n].dtype in _LOW_PRECISION:
                    lowest = env[n].dtype
        except Exception as e:  # noqa: BLE001 - a region this replay cannot run is reported, not raised
            return Fail(n, f"evaluating the AttnRes mixer's region failed at {describe(n)}: {type(e).__name__}: {e}"[:300])
        out = env[f.mixed]
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(dims):
            return Fail(f.mixed, f"the AttnRes mixer's region gives {getattr(out, 'shape', out)}, not {dims}")
    return out, base, w, lowest, env


def _evaluate(f: _Found, fp32: bool, eps_candidates) -> tuple | Fail:
    """(relative error against the spec formula, tolerance, label): f's region run on random CPU
    tensors (`_replay`), all floats as fp32 or as the graph's dtypes."""
    r = _replay(f, fp32)
    if isinstance(r, Fail):
        return r
    out, base, w, lowest, _ = r
    with unset_fake_temporarily(), torch.no_grad():
        out = out.double()
        srcs = torch.stack([base[s].double() for s in f.sources])          # [S, M, H]
        wq = w[0].double() * w[1].double()
        best = float("inf")
        for eps in eps_candidates:
            nrm = srcs * torch.rsqrt(srcs.pow(2).mean(-1, keepdim=True) + eps)
            p = torch.softmax((nrm * wq).sum(-1), dim=0)
            ref_ = (p.unsqueeze(-1) * srcs).sum(0)
            err = ((out - ref_).abs().max() / ref_.abs().max().clamp_min(1e-12)).item()
            best = min(best, err if err == err else float("inf"))
    if fp32:
        return best, 1e-4, "fp32"
    tol = {torch.bfloat16: 4e-2, torch.float16: 1e-2}.get(lowest, 1e-4)
    return best, tol, f"as traced, {str(lowest).replace('torch.', '')}"


# The mixer spellings _mix_rounding tells apart (ops.reference.MIX_* bits), most common first: the keys
# rounded or fp32, normalised alone or by a key RMSNorm with w_norm as its weight (rounded after it or,
# transformers-style, before it), each with rsqrt / div / reciprocal norms, softmax or unrolled; and
# key norms computed in the 16-bit dtype itself.
_KEY_FORMS = (0, ref.MIX_KEY_FP32, ref.MIX_KEY_WEIGHTED, ref.MIX_KEY_WEIGHTED | ref.NORM_CAST_FIRST,
              ref.MIX_KEY_WEIGHTED | ref.MIX_KEY_FP32)
_MIX_CANDIDATES = tuple(k | inv | mix for mix in (0, ref.MIX_DIV)
                        for inv in (0, ref.NORM_DIV, ref.NORM_RECIP) for k in _KEY_FORMS) + tuple(
    k | mix for mix in (0, ref.MIX_DIV) for k in (ref.NORM_IN_DTYPE, ref.NORM_IN_DTYPE | ref.MIX_KEY_WEIGHTED))
_MIX_SEEN: dict = {}        # region signature -> mix_rounding (a model spells all its mixers alike)
_MIX_ELEMENTS = 1 << 18     # elements of [S, M, H] replayed per mixer (in trials of the region's shape)


def _region_signature(f: _Found, sources: list, w_norm: Node, eps: float) -> tuple:
    """What _mix_rounding's answer depends on, without node identities: the region's ops in order, each
    with its dtype and its arguments (a region node by position, a leaf by its role, a constant as is)."""
    pos = {n: i for i, n in enumerate(f.region)}
    order = {s: i for i, s in enumerate(sources)}

    def arg(a):
        if isinstance(a, Node):
            if a in pos:
                return ("n", pos[a])
            kind, v = f.leaves.get(a, ("?", None))
            if kind in ("src", "alias"):
                return (kind, order.get(v))
            if kind == "stack":
                return (kind, tuple(order.get(x) if isinstance(x, Node) else None for x in v))
            if kind == "weight":
                return (kind, a is w_norm)
            return (kind, str(v) if kind == "size" else None)
        return repr(a)

    return (len(sources), tuple(_sig(f.mixed) or ()), float(eps),
            tuple((str(n.target), str(getattr(val(n), "dtype", None)), tuple(map(arg, _flat_args(n.args))),
                   tuple(sorted((k, repr(v)) for k, v in n.kwargs.items() if not isinstance(v, Node))))
                  for n in f.region))


def _flat_args(args) -> list:
    out = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.extend(_flat_args(a))
        else:
            out.append(a)
    return out


def _mix_rounding(f: _Found, sources: list, w_norm: Node, w_qk: Node, eps: float) -> int:
    """The MIX_* bits whose reference (ops.reference.mix_logits / mix_sources over `sources` in this
    order) reproduces f's region as traced: the region replayed on random tensors in its own dtypes
    (up to 16 draws), each candidate's mixed output compared element by element, rounded (what the op
    returns) and, where the region rounds its fp32 sum last, before that rounding (which tells apart
    spellings that round alike on most draws). After each draw only the candidates with the fewest
    rounded differences stay; the one with the fewest differences wins (none, where the spelling is one
    of the candidates). In fp32 every candidate agrees to fp32 rounding: 0."""
    lowp = [n for n in (*f.sources, f.mixed) if getattr(val(n), "dtype", None) in _LOW_PRECISION]
    if not lowp:
        return 0
    sig = _region_signature(f, sources, w_norm, eps)
    if sig in _MIX_SEEN:
        return _MIX_SEEN[sig]
    numel = len(sources)
    for d in shape(f.mixed):
        numel *= concrete(d) or 1
    trials = max(1, min(16, _MIX_ELEMENTS // max(numel, 1)))
    pre = f.mixed.args[0] if is_call(f.mixed) and f.mixed.target in CONVERT_OPS else None
    wrong = {c: [0, 0] for c in _MIX_CANDIDATES}
    alive = list(_MIX_CANDIDATES)
    for t in range(trials):
        r = _replay(f, False, seed=4321 + t)
        if isinstance(r, Fail):
            return 0
        out, base, w, _, env = r
        exact = env.get(pre) if pre is not None else None
        if not (isinstance(exact, torch.Tensor) and exact.dtype == torch.float32):
            exact = None
        wn, wq = (w[f.weights.index(x)] for x in (w_norm, w_qk))
        with unset_fake_temporarily(), torch.no_grad():
            srcs = [base[s] for s in sources]
            stacked = torch.stack(srcs, 0)
            logits: dict = {}
            for c in alive:
                k = c & ~ref.MIX_DIV   # the logits do not depend on how they are mixed
                if k not in logits:
                    logits[k] = ref.mix_logits(stacked, wn, wq, eps, c)
                mixed32 = _mixed_fp32(srcs, logits[k], c)
                wrong[c][0] += int((mixed32.to(out.dtype) != out).sum())
                if exact is not None:
                    wrong[c][1] += int((mixed32 != exact).sum())
        # a candidate behind in rounded differences is out (the model's own spelling has none)
        fewest = min(wrong[c][0] for c in alive)
        alive = [c for c in alive if wrong[c][0] == fewest]
        if len(alive) == 1 and t:
            break
    best = min(alive, key=lambda c: (*wrong[c], _MIX_CANDIDATES.index(c)))
    if len(_MIX_SEEN) > 256:
        _MIX_SEEN.clear()
    _MIX_SEEN[sig] = best
    return best


def _mixed_fp32(sources: list, logits: torch.Tensor, c: int) -> torch.Tensor:
    """ops.reference.mix_sources before its final rounding (the same ops: rounding it gives that)."""
    return ref.mix_sources([s.float() for s in sources], logits, c)
