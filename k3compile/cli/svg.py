"""Per-layer pictures of an FX graph as plain SVG (no graphviz).

Nodes are grouped into decoder layers by their module path (`nn_module_stack`: `...layers.3...`),
weights by their AOT input name, and, in graphs without module paths (e.g. loaded from another
program), by the attention cores they follow. Each layer is laid out by topological depth: one
row per depth, boxes in graph order, edges as curves from producer to consumer. Fused `k3::` ops
are filled in amber, attention cores and experts (`k3model::`) in blue, collectives in green,
weights and graph inputs in grey; values from other layers are dashed stubs. Hovering a box
shows the node as code and its source line.
"""
from __future__ import annotations

import html
import re
from collections import defaultdict

from torch.fx import Graph, Node

from ..report import node_code, node_source

W, H, GX, GY, MARGIN, HEAD = 184, 34, 14, 30, 16, 64
_LAYER = re.compile(r"layers\W+(?:_modules\W+)?(\d+)")

STYLE = {  # kind -> (fill, stroke, stroke width, dash)
    "k3": ("#ffb000", "#a86400", 2.5, ""),
    "core": ("#cfe3ff", "#3b6db3", 1.2, ""),
    "comm": ("#d5f2cc", "#3f8a2e", 1.2, ""),
    "input": ("#ececec", "#888888", 1.0, ""),
    "stub": ("#ffffff", "#999999", 1.0, "4 3"),
    "op": ("#ffffff", "#555555", 1.0, ""),
}
LEGEND = [("k3", "fused k3:: op"), ("core", "attention core / experts"), ("comm", "collective"),
          ("input", "weight / input"), ("stub", "from another layer"), ("op", "ATen op")]


def _ns_of(t) -> str:
    s = getattr(t, "_schema", None)
    return s.name.split("::")[0] if s is not None else ""


def kind(n: Node) -> str:
    if n.op in ("placeholder", "get_attr"):
        return "input"
    if n.op != "call_function":
        return "op"
    ns = _ns_of(n.target)
    if ns == "k3":
        return "k3"
    if ns == "k3model" or (n.args and _ns_of(n.args[0]) == "k3model"):  # also auto_functionalized(k3model op)
        return "core"
    if ns in ("_c10d_functional", "c10d_functional"):
        return "comm"
    return "op"


def short_target(n: Node) -> str:
    if n.op == "placeholder":
        return str(n.meta.get("k3c_input") or "graph input")
    if n.op == "get_attr":
        return f"self.{n.target}"
    if n.op != "call_function":
        return n.op
    t = n.target
    s = getattr(t, "_schema", None)
    if s is not None:
        ns, name = s.name.split("::")
        return name if ns in ("aten", "prims") else f"{ns}::{name}"
    name = getattr(t, "__name__", str(t))
    if name == "getitem" and len(n.args) > 1:
        return f"getitem [{n.args[1]}]"
    if n.args and getattr(n.args[0], "_schema", None) is not None:  # auto_functionalized(op, ...)
        return f"{name}({n.args[0]._schema.name.split('::')[1]})"
    return name


def _meta_layer(n: Node) -> int | None:
    for path in reversed([v[0] for v in (n.meta.get("nn_module_stack") or {}).values()]):
        m = _LAYER.search(str(path))
        if m:
            return int(m.group(1))
    if n.op == "placeholder":
        m = _LAYER.search(str(n.meta.get("k3c_input", "")))
        if m:
            return int(m.group(1))
    return None


def layers_of(graph: Graph, attention: list | None = None) -> tuple[dict[Node, int], bool]:
    """(node -> decoder layer index for the nodes in a layer, whether module paths gave them; if
    not, index k is the segment of ops after attention core k-1 up to core k)."""
    out = {n: i for n in graph.nodes if (i := _meta_layer(n)) is not None}
    by_module = bool(out)
    if not out and attention:  # no module paths: split the graph at the attention cores
        core_pos = {c: k for k, c in enumerate(attention)}
        seg = 0  # segment k: the ops after attention core k-1, up to and including core k
        for n in graph.nodes:
            if n.op == "call_function":
                out[n] = seg
                if n in core_pos:
                    seg = min(core_pos[n] + 1, len(attention) - 1)
    for n in graph.nodes:  # weights and inputs: the layer of their first user
        if n not in out and n.op in ("placeholder", "get_attr"):
            us = [out[u] for u in n.users if u in out]
            if us:
                out[n] = min(us)
    return out, by_module


def _flat(a):
    if isinstance(a, Node):
        yield a
    elif isinstance(a, (list, tuple)):
        for x in a:
            yield from _flat(x)
    elif isinstance(a, dict):
        for x in a.values():
            yield from _flat(x)


def render_layer(nodes: list[Node], title: str) -> str:
    """SVG text for one layer's nodes (in graph order)."""
    inside = set(nodes)
    compute = [n for n in nodes if n.op == "call_function"]
    stubs: dict[Node, None] = {}
    preds: dict[Node, list[Node]] = {}
    for n in compute:
        ps = []
        for a in _flat((n.args, n.kwargs)):
            if a not in inside:
                stubs.setdefault(a, None)
            if a not in ps:
                ps.append(a)
        preds[n] = ps
    depth: dict[Node, int] = {}
    for n in compute:
        depth[n] = 1 + max((depth[p] for p in preds[n] if p in depth), default=0)
    users: dict[Node, list[Node]] = defaultdict(list)
    for n in compute:
        for p in preds[n]:
            users[p].append(n)
    for n in [*[m for m in nodes if m.op != "call_function"], *stubs]:
        if users.get(n):
            depth[n] = max(0, min(depth[u] for u in users[n]) - 1)
    rows: dict[int, list[Node]] = defaultdict(list)
    for n in [*stubs, *nodes]:
        if n in depth:
            rows[depth[n]].append(n)
    # order each row by the mean position of its producers (one top-down sweep)
    xpos: dict[Node, float] = {}
    for d in sorted(rows):
        row = rows[d]
        bary = {n: (sum(xpos[p] for p in preds.get(n, []) if p in xpos) /
                    max(1, sum(1 for p in preds.get(n, []) if p in xpos))) if any(p in xpos for p in preds.get(n, []))
                else i for i, n in enumerate(row)}
        row.sort(key=lambda n: bary[n])
        for i, n in enumerate(row):
            xpos[n] = i
    width_n = max((len(r) for r in rows.values()), default=1)
    width = max(width_n * (W + GX) + 2 * MARGIN, 720)
    height = HEAD + (max(rows, default=0) + 1) * (H + GY) + MARGIN
    pos: dict[Node, tuple[float, float]] = {}
    for d, row in rows.items():
        x0 = (width - len(row) * (W + GX) + GX) / 2
        for i, n in enumerate(row):
            pos[n] = (x0 + i * (W + GX), HEAD + d * (H + GY))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="DejaVu Sans Mono, Menlo, monospace" font-size="11">',
           '<defs><marker id="a" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="6" markerHeight="6" '
           'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#777"/></marker></defs>',
           '<rect width="100%" height="100%" fill="#fafafa"/>',
           f'<text x="{MARGIN}" y="22" font-size="15" font-weight="bold">{html.escape(title)}</text>']
    lx = MARGIN
    for k, label in LEGEND:
        fill, stroke, sw, dash = STYLE[k]
        out.append(f'<rect x="{lx}" y="34" width="14" height="12" fill="{fill}" stroke="{stroke}" '
                   f'stroke-width="{sw}"' + (f' stroke-dasharray="{dash}"' if dash else "") + "/>")
        out.append(f'<text x="{lx + 18}" y="44">{html.escape(label)}</text>')
        lx += 24 + 7 * len(label)
    for n in compute:  # edges first, boxes on top
        x2, y2 = pos[n]
        for p in preds[n]:
            if p not in pos:
                continue
            x1, y1 = pos[p]
            ax, ay, bx, by = x1 + W / 2, y1 + H, x2 + W / 2, y2
            dy = max(12.0, (by - ay) / 2)
            out.append(f'<path d="M{ax:.0f},{ay:.0f} C{ax:.0f},{ay + dy:.0f} {bx:.0f},{by - dy:.0f} {bx:.0f},{by:.0f}" '
                       f'fill="none" stroke="#9a9a9a" stroke-width="1" marker-end="url(#a)"/>')
    for n, (x, y) in pos.items():
        k = "stub" if n in stubs else kind(n)
        fill, stroke, sw, dash = STYLE[k]
        tip = node_code(n) + (f"\n{node_source(n)}" if node_source(n) else "")
        line2 = short_target(n)
        if n in stubs:
            line2 = "from elsewhere"
        out.append(f'<g><title>{html.escape(tip)}</title>'
                   f'<rect x="{x:.0f}" y="{y:.0f}" width="{W}" height="{H}" rx="5" fill="{fill}" stroke="{stroke}" '
                   f'stroke-width="{sw}"' + (f' stroke-dasharray="{dash}"' if dash else "") + "/>"
                   f'<text x="{x + 6:.0f}" y="{y + 14:.0f}" font-weight="bold">{html.escape(_cut(n.name, 25))}</text>'
                   f'<text x="{x + 6:.0f}" y="{y + 27:.0f}" fill="#333">{html.escape(_cut(line2, 27))}</text></g>')
    out.append("</svg>")
    return "\n".join(out)


def _cut(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "~"


def write_layers(out_dir, before: Graph, after: Graph, attention_before=None, attention_after=None) -> list:
    """layer_NN.before.svg / layer_NN.after.svg for every layer, and an index.html showing them
    side by side. Returns the files written."""
    import pathlib
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files, rows = [], []
    groups, by_module = {}, True
    for tag, g, att in (("before", before, attention_before), ("after", after, attention_after)):
        lay, by_mod = layers_of(g, att)
        by_module = by_module and by_mod
        per: dict[int, list[Node]] = defaultdict(list)
        for n in g.nodes:
            if n in lay:
                per[lay[n]].append(n)
        groups[tag] = per
    label = (lambda i: f"layer {i}") if by_module else (lambda i: f"segment {i} (up to attention core {i})")
    for i in sorted(set(groups["before"]) | set(groups["after"])):
        cells = []
        for tag in ("before", "after"):
            nodes = groups[tag].get(i, [])
            fused = sum(1 for n in nodes if kind(n) == "k3")
            ops = sum(1 for n in nodes if n.op == "call_function")
            title = (f"{label(i)}, {tag} the K3 passes: {ops} ops"
                     + (f", {fused} fused k3:: ops" if fused else ""))
            f = out_dir / f"layer_{i:02d}.{tag}.svg"
            f.write_text(render_layer(nodes, title))
            files.append(f)
            cells.append(f'<td><a href="{f.name}"><img src="{f.name}" alt="{html.escape(title)}"></a>'
                         f"<br>{html.escape(title)}</td>")
        rows.append(f"<tr><th>{html.escape(label(i))}</th>{''.join(cells)}</tr>")
    index = out_dir / "index.html"
    index.write_text("<!doctype html><meta charset=utf-8><title>k3c: layers before and after the passes</title>"
                     "<style>img{max-width:46vw;border:1px solid #ccc}td{vertical-align:top}</style>"
                     "<table><tr><th></th><th>before</th><th>after</th></tr>" + "".join(rows) + "</table>")
    files.append(index)
    return files
